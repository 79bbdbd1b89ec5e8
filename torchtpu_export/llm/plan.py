"""Which programs an LLM artifact holds, in one place: :class:`StepPlan`. ``export_llm`` makes one from its options
and exports the programs it lists (:meth:`StepPlan.programs`); the serving engine makes one back from an
artifact's signatures (:meth:`StepPlan.of`) and asks it which program takes each of its calls. The signature
names (LiteRT-LM's ``prefill_<N>`` and ``decode``, the serving engine's batched, paged and mixed steps) are built
and read here only."""
from __future__ import annotations

import dataclasses
import re

# what LiteRT-LM and litert-torch call the signatures (the bundle contract)
PREFILL = "prefill_{}"
DECODE = "decode"
DECODE_BATCH = "decode_batch"  # tpu serving: one token for each of B sequences (slots), each at its own position
# a smaller batch of the same step, for a light load (``b`` rows; exported for ``b`` in ``batch_buckets``): the engine
# steps the busy rows through the smallest that holds them, not every slot
DECODE_BUCKET = "decode_batch_{}"
PREFILL_BATCH = "prefill_batch_{}"  # tpu serving: N prompt tokens for each of B slots, each row from its own start
# tpu serving over a paged KV cache (``export_llm(..., kv_pages=...)``): the same steps, the caches a pool of pages
# shared by all rows, each row's pages in its ``page_table`` row
DECODE_PAGED = "decode_paged"
DECODE_PAGED_ONE = "decode_paged_1"  # one row of the batch alone (its page table's row): no idle row stepped
DECODE_PAGED_BUCKET = "decode_paged_{}"  # ``b`` rows of the batch (``batch_buckets``), as DECODE_BUCKET
PREFILL_PAGED = "prefill_paged_{}"  # N prompt tokens for each of B rows, each row from its own start
PREFILL_PAGED_BUCKET = "prefill_paged_{}_rows_{}"  # the same, N tokens for b rows (``batch_buckets``, and 1)
# a mixed step, packed (``contract.mixed_inputs``): b decode tokens (one per decoding row) and one row's N prompt
# tokens in one sequence of b + N tokens, so a step computes the tokens it carries, not rows x chunk length
MIXED_PAGED = "mixed_paged_{}"  # B decode lanes
MIXED_PAGED_BUCKET = "mixed_paged_{}_rows_{}"  # b decode lanes (``batch_buckets``, and 1)
# the same with B lanes and the N prompt tokens in k blocks of N / k, each block a row's: up to k arriving prompts
# share the step (k: ``mixed_chunks``, at most MIXED_CHUNKS)
MIXED_PAGED_BLOCKS = "mixed_paged_{}_blocks_{}"
MIXED_CHUNKS = 4
# a vision-language model on the tpu target: ``vision`` (``images [1, H, W, 3]`` in [0, 1] -> ``embeddings
# [1, R, D]``, an image's rows) and a prefill taking ``image_rows [1, N, D]`` beside its tokens (row ``i`` put in
# where token ``i`` is the image token, as transformers merges them)
VISION = "vision"
PREFILL_IMAGE = "prefill_image_{}"


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the plan: its signature name, its kind (``prefill``, ``decode``, ``image_prefill``,
    ``vision``, ``batch_decode``, ``batch_prefill``, ``paged_decode``, ``paged_prefill``, ``mixed``), the
    prompt tokens it takes per row (a mixed step: its prompt tokens), the rows (sequences, or a mixed step's decode
    lanes) it steps, and a mixed step's prompt blocks."""

    name: str
    kind: str
    tokens: int = 1
    rows: int = 1
    blocks: int = 1


def mixed_chunks(n: int, rows: int) -> int:
    """The blocks of a mixed step's ``n`` prompt tokens for a batch of ``rows``: the most, up to MIXED_CHUNKS and
    ``rows``, that divide ``n``."""
    return max(k for k in range(1, min(MIXED_CHUNKS, rows) + 1) if n % k == 0)


def default_buckets(batch_size: int) -> list[int]:
    """The smaller batches exported beside a ``batch_size``-row decode by default: 4, 16, 64, ... below it (a
    light load then steps at most four times the rows it has)."""
    out, b = [], 4
    while b < batch_size:
        out.append(b)
        b *= 4
    return out


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The programs of an LLM artifact. ``lengths``: the prefill lengths; ``rows``: the batch's rows (1: the
    one-slot ``decode`` alone); ``buckets``: the smaller decode batches; ``paged``: the batch steps over a paged
    KV cache; ``batched_prefill``: a slot batch's prompts prefilled together in place (not with recurrent
    states); ``images``: a VLM's ``vision`` program and image prefills. ``names``: the signatures an artifact
    holds (:meth:`of`; an export's plan holds what :meth:`programs` lists)."""

    lengths: tuple[int, ...]
    rows: int = 1
    buckets: tuple[int, ...] = ()
    paged: bool = False
    batched_prefill: bool = True
    images: bool = False
    names: frozenset = None

    def __post_init__(self):
        if self.names is None:
            object.__setattr__(self, "names", frozenset(p.name for p in self.programs()))

    def programs(self) -> list[Program]:
        """Every program an export of this plan holds, in the order it exports them."""
        out = [Program(PREFILL.format(n), "prefill", n) for n in self.lengths]
        out.append(Program(DECODE, "decode"))
        if self.images:
            out += [Program(PREFILL_IMAGE.format(n), "image_prefill", n) for n in self.lengths]
            out.append(Program(VISION, "vision"))
        smaller = [1, *self.buckets] if self.rows > 1 else []
        if self.paged:
            out.append(Program(DECODE_PAGED, "paged_decode", 1, self.rows))
            out += [Program(DECODE_PAGED_BUCKET.format(b), "paged_decode", 1, b) for b in smaller]
            for n in self.lengths:
                out += [Program(self.prefill_paged(n, b), "paged_prefill", n, b) for b in [self.rows, *smaller]]
                out += [Program(self.mixed(n, b), "mixed", n, b) for b in [self.rows, *smaller]]
                k = mixed_chunks(n, self.rows)
                if k > 1:
                    out.append(Program(self.mixed(n, self.rows, k), "mixed", n, self.rows, k))
        elif self.rows > 1:
            out.append(Program(DECODE_BATCH, "batch_decode", 1, self.rows))
            out += [Program(DECODE_BUCKET.format(b), "batch_decode", 1, b) for b in self.buckets]
            if self.batched_prefill:
                out += [Program(PREFILL_BATCH.format(n), "batch_prefill", n, self.rows) for n in self.lengths]
        return out

    @classmethod
    def of(cls, signatures) -> "StepPlan":
        """The plan of an artifact whose programs are ``signatures`` (an artifact of an older version may lack some
        of what a plan of its options lists: :meth:`has` says)."""
        names = frozenset(signatures)
        lengths = _numbers(names, r"prefill_(\d+)")
        paged = DECODE_PAGED in names
        slot_buckets = _numbers(names, r"decode_batch_(\d+)")
        paged_buckets = [b for b in _numbers(names, r"decode_paged_(\d+)") if b > 1]
        if paged:
            lengths = lengths or _numbers(names, r"prefill_paged_(\d+)")
        return cls(tuple(lengths), rows=1, buckets=tuple(paged_buckets if paged else slot_buckets), paged=paged,
                   batched_prefill=any(n.startswith("prefill_batch_") for n in names),
                   images=VISION in names, names=names)

    def has(self, name: str) -> bool:
        return name in self.names

    @property
    def paged_lengths(self) -> list[int]:
        """The lengths of a paged artifact's ``prefill_paged_<N>`` programs."""
        return _numbers(self.names, r"prefill_paged_(\d+)")

    def decode_buckets(self) -> list[int]:
        """The row counts of the artifact's smaller decode batches (``decode_batch_<b>``, or paged
        ``decode_paged_<b>``, ``decode_paged_1`` among them), ascending."""
        return _numbers(self.names, r"decode_paged_(\d+)" if self.paged else r"decode_batch_(\d+)")

    # the names of the programs the engine calls
    @staticmethod
    def prefill(n: int) -> str:
        return PREFILL.format(n)

    @staticmethod
    def prefill_image(n: int) -> str:
        return PREFILL_IMAGE.format(n)

    @staticmethod
    def prefill_batch(n: int) -> str:
        return PREFILL_BATCH.format(n)

    @staticmethod
    def decode_bucket(rows: int) -> str:
        return DECODE_BUCKET.format(rows)

    @staticmethod
    def decode_paged_bucket(rows: int) -> str:
        return DECODE_PAGED_BUCKET.format(rows)

    def prefill_paged(self, n: int, rows: int) -> str:
        """``prefill_paged_<N>`` for the batch's rows, ``prefill_paged_<N>_rows_<b>`` for fewer (an artifact's plan
        learns the batch's rows from its engine: :meth:`with_rows`)."""
        return PREFILL_PAGED.format(n) if rows == self.rows else PREFILL_PAGED_BUCKET.format(n, rows)

    def mixed(self, n: int, lanes: int, blocks: int = 1) -> str:
        """``mixed_paged_<N>`` (the batch's lanes), ``mixed_paged_<N>_rows_<b>`` (fewer) or
        ``mixed_paged_<N>_blocks_<k>`` (the batch's lanes, ``k`` prompt blocks)."""
        if blocks > 1:
            return MIXED_PAGED_BLOCKS.format(n, blocks)
        return MIXED_PAGED.format(n) if lanes == self.rows else MIXED_PAGED_BUCKET.format(n, lanes)

    def with_rows(self, rows: int) -> "StepPlan":
        """This plan with the batch's rows (an engine reads them off its decode program's inputs)."""
        return dataclasses.replace(self, rows=rows)


def _numbers(names, pattern: str) -> list[int]:
    return sorted(int(m.group(1)) for m in (re.fullmatch(pattern, s) for s in names) if m)
