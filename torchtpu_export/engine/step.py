"""The engine's device work: the jitted calls of an LLM's exported programs (a prefill chunk, a decode
step of every slot that samples on the device, a prefilled request's insert into the batch), the state
rows they carry, and host values put on the engine's devices. Nothing here schedules: the scheduler
(:mod:`.scheduler`) decides what to call and when."""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("torchtpu_export.engine")


class Prepared:
    """One of the engine's jitted device functions and, once :meth:`compile` has run, its executable for the
    argument shapes the engine calls it with (each function is called with one set of shapes). A call then
    compiles nothing; a call whose shapes or shardings differ from the compiled ones is logged and counted
    in ``Prepared.late`` and takes the jitted path, which compiles (never a failed request)."""
    late = 0  # calls that compiled at serve time, every engine of the process together

    __slots__ = ("jitted", "compiled")

    def __init__(self, jitted):
        self.jitted, self.compiled = jitted, None

    def compile(self, *args, platforms: tuple[str, ...] | None = None):
        """Compiles for ``args`` (arrays or ``jax.ShapeDtypeStruct`` with their shardings; ``platforms``: lower
        for these, e.g. ``("tpu",)`` on a host without one); returns the executable."""
        traced = self.jitted.trace(*abstract(args))
        self.compiled = traced.lower(**({"lowering_platforms": platforms} if platforms else {})).compile()
        return self.compiled

    def shapes(self, *args):
        """The outputs for ``args`` as ``jax.ShapeDtypeStruct`` with shardings, compiling nothing."""
        import jax
        return jax.tree.map(_plain, self.jitted.trace(*abstract(args)).out_info)

    def load(self, blob: bytes, *args, devices: list, loader) -> None:
        """The executable stored for ``args``, loaded for ``devices`` by ``loader`` (the program's
        ``load_executable``: the stored bytes' format is its target's); ArtifactError when it takes other
        arguments than ``args`` or gives other results than this function does."""
        import jax
        from ..errors import ArtifactError
        args = abstract(args)
        out_info = self.jitted.trace(*args).out_info
        compiled = loader(blob, uses_x64=jax.config.jax_enable_x64, devices=devices,
                          trees=(jax.tree.structure((args, {})), jax.tree.structure(out_info)))

        def avals(tree):
            return [(tuple(a.shape), np.dtype(a.dtype)) for a in jax.tree.leaves(tree)]
        if avals(args) != avals(compiled.in_avals):
            raise ArtifactError("a stored executable takes other arguments than this engine passes",
                                hint="compile the file again for this server (torchtpu-export compile)")
        # results of other shapes would be the engine's next arguments: a failure far from its cause
        if avals(out_info) != avals(compiled.out_info):
            raise ArtifactError("a stored executable gives other results than this engine's call",
                                hint="compile the file again for this server (torchtpu-export compile)")
        self.compiled = compiled

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except (TypeError, ValueError) as e:  # jax's argument checks, raised before it runs
                import jax
                if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(args)):
                    raise  # it ran after all, and its donated arguments are gone: never run twice
                Prepared.late += 1
                log.warning("a device call compiles at serve time: its arguments are not the compiled ones "
                            "(%s)", str(e).splitlines()[0][:300])
                self.compiled = None
        return self.jitted(*args)


class Executables:
    """How an engine's device functions get their executables: loaded from the file's stored ones for these
    ``devices`` where the file was loaded as trusted (``trust_stored_executables``), else compiled; a file
    not trusted has its stored ones never read (counted in ``stats["stored_executables_ignored"]`` and said
    once in the log). Over chips not attached (``program.abstract``) nothing is made, only shapes."""

    def __init__(self, program, devices: list, stats: dict):
        self.program, self.devices, self.stats = program, devices, stats
        self._stored: dict | None = None

    def warm(self, calls) -> float:
        """Readies each of ``calls`` (``(name, function, arguments)``, the engine's ``calls()``), so that serving
        compiles nothing. Raises ArtifactError when a trusted file stores executables that cannot run here, or
        lacks one of the calls. Returns the seconds taken."""
        import time

        from ..errors import ArtifactError
        t0 = time.perf_counter()
        self._say_ignored()
        stored = self.program.stored_calls(self.devices)
        for name, fn, args in calls:
            if stored is None:
                fn.compile(*args)
            elif name in stored:
                self._load(fn, name, stored[name], *args)
            else:
                raise ArtifactError(f"the file's stored executables lack the engine call {name!r}: they were "
                                    "compiled for the server's defaults (batched, prefix cache), or by an older "
                                    "torchtpu-export", hint="serve with the defaults, compile the file again "
                                    "(torchtpu-export compile), serve without --trust-stored-executables to compile "
                                    "every call at start, or with --no-warm to compile each on first use")
        self.stats["warm_seconds"] = round(time.perf_counter() - t0, 3)
        self.stats["stored_executables"] = 0 if stored is None else len(stored)
        return self.stats["warm_seconds"]

    def made(self, fn, name: str):
        """What ``fn()`` (the engine call ``name``, of no arguments) makes on the devices: through the file's
        stored executable when it has one for these devices (the engine starts without compiling), abstract
        without chips."""
        if self.program.abstract:
            return fn.shapes()
        blob = self._stored_here().get(name)
        if blob is not None:
            self._load(fn, name, blob)
        return fn()

    def _load(self, fn, name: str, blob: bytes, *args) -> None:
        from ..errors import ArtifactError
        try:
            fn.load(blob, *args, devices=self.devices, loader=self.program.load_executable)
        except ArtifactError as e:
            raise ArtifactError(f"the file's stored engine call {name!r}: {e}", hint=e.hint) from e

    def _stored_here(self) -> dict:
        """The file's stored executables for these devices (none where it has none, is not trusted, or has
        none that run here: :meth:`warm` says why)."""
        if self._stored is None:
            from ..errors import ArtifactError
            self._say_ignored()
            try:
                self._stored = self.program.stored_calls(self.devices) or {}
            except ArtifactError:
                self._stored = {}
        return self._stored

    def _say_ignored(self) -> None:
        """The file's stored executables left unread because it is not trusted: counted in the stats, and
        said once in the log (a user who compiled the file learns why the engine compiles)."""
        ignored = self.program.ignored_calls()
        if ignored and "stored_executables_ignored" not in self.stats:
            log.warning("ignoring the file's %d stored engine executables: they are native code, loaded only from "
                        "a file marked trusted (--trust-stored-executables; tte.load(path, "
                        "trust_stored_executables=True)); compiling the engine's calls instead", ignored)
        self.stats["stored_executables_ignored"] = ignored


def devices_of(runner, device) -> list:
    """The devices of an engine whose decode program is ``runner``: its mesh's, or its one ``device``."""
    return [device] if runner.mesh is None else list(runner.mesh.devices.flat)


def _plain(o):
    import jax
    return jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=getattr(o.sharding, "sharding", o.sharding))


def abstract(tree):
    """Arrays (a tree of them) as ``jax.ShapeDtypeStruct`` with their shardings; abstract values as they are."""
    import jax

    def one(x):
        return x if isinstance(x, jax.ShapeDtypeStruct) else \
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(one, tree)


def output_tree(program, sig: str):
    """The pytree spec of signature ``sig``'s outputs (its call metadata's)."""
    from .. import treespec
    return treespec.loads(program.call_metadata(sig)["out_spec"])


def program_call(runner, out_spec, length: int, cache_names: list[str], slots: bool):
    """``call(weights, tokens, pos, caches[, page_table]) -> (logits, caches)`` over ``runner``'s exported
    program, traced inside a jitted step: the attention mask from the positions (``slots``: ``pos`` is each
    row's first position; else each query's position of the one sequence). A paged program
    (``decode_paged``, ``prefill_paged_<N>``, ``mixed_paged_<N>``) takes each row's pages too, and no mask."""
    import torch.utils._pytree as pytree
    names = [s.name for s in runner.inputs]
    exported, n_out = runner.exported, len(runner.outputs)

    def call(weights, tokens, pos, caches, table=None, image_rows=None):
        import jax.numpy as jnp
        feed = {"tokens": tokens, "input_pos": pos, "page_table": table, "image_rows": image_rows,
                **dict(zip(cache_names, caches))}
        if "mask" in names:
            # [B, N]: each query's position (slots: input_pos is each row's first position)
            rows = pos[:, None] + jnp.arange(tokens.shape[1], dtype=pos.dtype) if slots else pos[None]
            visible = jnp.arange(length)[None, None, :] <= rows[:, :, None]
            feed["mask"] = jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)[:, None]
        outs = pytree.tree_unflatten(list(exported.call(weights, *[feed[n] for n in names]))[:n_out], out_spec)
        return outs.get("logits"), tuple(outs[n] for n in cache_names)
    return call


def jit_prefill(runner, out_spec, length: int, cache_names: list[str], slots: bool = False):
    """``prefill(weights, tokens, start, caches[, page_table]) -> caches``, the caches donated: one request's
    chunk from position ``start`` (``prefill_<N>``), or with ``slots`` every row of the batch from its own
    start (``prefill_batch_<N>``, ``prefill_paged_<N>``)."""
    import jax
    call = program_call(runner, out_spec, length, cache_names, slots)

    def prefill(weights, tokens, start, caches, *table):
        import jax.numpy as jnp
        pos = start if slots else start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return call(weights, tokens, pos, caches, *table)[1]
    return Prepared(jax.jit(prefill, donate_argnums=(3,)))


def jit_prefill_image(runner, out_spec, length: int, cache_names: list[str]):
    """``prefill(weights, tokens, start, caches, image_rows) -> caches``, the caches donated: one request's chunk
    from position ``start`` through ``prefill_image_<N>``, ``image_rows [1, N, D]`` put in where its tokens
    are the image token."""
    import jax
    call = program_call(runner, out_spec, length, cache_names, False)

    def prefill(weights, tokens, start, caches, image_rows):
        import jax.numpy as jnp
        return call(weights, tokens, start + jnp.arange(tokens.shape[1], dtype=jnp.int32), caches,
                    image_rows=image_rows)[1]
    return Prepared(jax.jit(prefill, donate_argnums=(3,)))


def jit_vision(runner, out_spec):
    """``vision(weights, images [1, H, W, 3]) -> [1, R, D]``: an image's rows (the ``vision`` program)."""
    import jax
    import torch.utils._pytree as pytree
    exported, n_out = runner.exported, len(runner.outputs)

    def vision(weights, images):
        return pytree.tree_unflatten(list(exported.call(weights, images))[:n_out], out_spec)["embeddings"]
    return Prepared(jax.jit(vision))


def jit_decode(runner, out_spec, length: int, cache_names: list[str], slots: bool, top: int = 0):
    """``decode(weights, state, caches, allowed[, page_table]) -> ((tokens, logprobs, top values, top ids),
    state, caches)``, state and caches donated: one step of every slot. Each slot's logits go through its
    processors (:func:`process`: penalties, logit bias, and ``allowed``, a ``[B, ceil(V / 32)]`` int32
    bitmask of the tokens a grammar or ``min_tokens`` lets through), then are sampled with its own key and
    parameters (:func:`state_rows`). ``logprobs`` is each sampled token's log-probability under the model
    (the raw logits' log-softmax); with ``top`` > 0 also the ``top`` most likely tokens and theirs."""
    import jax
    return Prepared(jax.jit(_decode_body(runner, out_spec, length, cache_names, slots, top),
                            donate_argnums=(1, 2)))


def jit_decode_rows(runner, out_spec, length: int, cache_names: list[str], top: int = 0):
    """``decode_rows(weights, state, caches, allowed, page_table, rows) -> (outputs, state, caches)``, state and
    caches donated: one step of batch rows ``rows`` (int32 ``[b]``; one past the batch: a padding row) through
    a smaller paged program (``decode_paged_<b>``): their state rows taken, stepped and sampled as
    :func:`jit_decode` does, and written back; the pool is the batch's (``allowed`` and ``page_table`` are the
    rows', the outputs ``[b, ...]``)."""
    import jax
    body = _decode_body(runner, out_spec, length, cache_names, True, top)

    def decode_rows(weights, state, caches, allowed, table, rows):
        outs, part, caches = body(weights, _take(state, rows), caches, allowed, table)
        return outs, _put_back(state, part, rows), caches
    return Prepared(jax.jit(decode_rows, donate_argnums=(1, 2)))


def jit_take_rows():
    """``take(state, caches, rows) -> (state, caches)``: the batch's state and cache rows ``rows`` (int32
    ``[b]``), as a smaller decode batch takes them (a copy of those rows)."""
    import jax

    def take(state, caches, rows):
        return _take(state, rows), _take(caches, rows)
    return Prepared(jax.jit(take))


def jit_put_rows():
    """``put_rows(state, caches, part_state, part_caches, rows) -> (state, caches)``: :func:`jit_take_rows`'s
    rows back into the batch's (donated: written in place); a row index past the batch is dropped."""
    import jax

    def put_rows(state, caches, part_state, part_caches, rows):
        return _put_back(state, part_state, rows), _put_back(caches, part_caches, rows)
    return Prepared(jax.jit(put_rows, donate_argnums=(0, 1)))


def _take(arrays, rows) -> tuple:
    """(traced) Rows ``rows`` of each array (a row index past the batch, padding, reads its last row)."""
    import jax.numpy as jnp
    return tuple(x[jnp.clip(rows, 0, x.shape[0] - 1)] for x in arrays)


def _put_back(arrays, parts, rows) -> tuple:
    """(traced) :func:`_take`'s rows ``parts`` written back at ``rows`` (a row index past the batch: dropped)."""
    return tuple(x.at[rows].set(o, mode="drop") for x, o in zip(arrays, parts))


def _decode_body(runner, out_spec, length: int, cache_names: list[str], slots: bool, top: int):
    """The traced body of :func:`jit_decode`."""
    call = program_call(runner, out_spec, length, cache_names, slots)

    def decode(weights, state, caches, allowed, *table):
        logits, caches = call(weights, state[0][:, None], state[1], caches, *table)
        outs, state = _sampled(logits[:, -1], state, allowed, top, length - 1)
        return outs, state, caches
    return decode


def jit_mixed(runner, out_spec, length: int, cache_names: list[str], top: int = 0):
    """``mixed(weights, state, caches, allowed, page_table, chunk, chunk_pos, lanes) -> (outputs, state, caches)``,
    state and caches donated: one packed mixed step (``mixed_paged_<N>``, ``llm.contract.mixed_inputs``): the
    batch rows ``lanes`` (int32 ``[b]``; one past the batch: a lane taking no part, its table row page 0) each
    run their next token from their state's position and are sampled as :func:`jit_decode` samples (their state
    rows written back; ``allowed [b, words]``); ``chunk [N]`` are prompt tokens at positions ``chunk_pos [N]``,
    in blocks of table rows ``b`` on (``page_table [b + blocks, T]``). The outputs are the lanes' (``[b, ...]``)."""
    import jax
    call = program_call(runner, out_spec, length, cache_names, slots=True)

    def mixed(weights, state, caches, allowed, table, chunk, chunk_pos, lanes):
        import jax.numpy as jnp
        part = _take(state, lanes)
        pos = jnp.where(lanes < state[0].shape[0], part[1], 0)
        tokens = jnp.concatenate([part[0], chunk])[None]
        logits, caches = call(weights, tokens, jnp.concatenate([pos, chunk_pos.astype(pos.dtype)]), caches, table)
        outs, part = _sampled(logits[0], part, allowed, top, length - 1)
        return outs, _put_back(state, part, lanes), caches
    return Prepared(jax.jit(mixed, donate_argnums=(1, 2)))


def _sampled(logits, state, allowed, top: int, last: int):
    """Each row's next token from its logits ``[B, V]`` (:func:`process`, then :func:`sample` with its own
    key), its log-probability (and the ``top`` most likely), and the state after the step."""
    import jax
    import jax.numpy as jnp
    tokens, pos, keys, temp, top_k, top_p, presence, frequency, repetition, counts, seen, bias = state
    keys = jax.vmap(jax.random.split)(keys)  # [B, 2, 2]: the slot's next key, this step's key
    raw = logits.astype(jnp.float32)
    x = process(raw, allowed, presence, frequency, repetition, counts, seen, bias)
    nxt = jax.lax.cond(jnp.any(temp > 0),
                       lambda: jax.vmap(sample)(x, keys[:, 1], temp, top_k, top_p),
                       lambda: jnp.argmax(x, axis=-1).astype(jnp.int32))
    rows = jnp.arange(nxt.shape[0])
    logp = jax.nn.log_softmax(raw, axis=-1)
    picked = logp[rows, nxt]
    if top:
        top_values, top_ids = jax.lax.top_k(logp, top)
    else:
        top_values, top_ids = jnp.zeros((nxt.shape[0], 0), jnp.float32), jnp.zeros((nxt.shape[0], 0), jnp.int32)
    counts = counts.at[rows, nxt].add(1)
    state = (nxt, jnp.minimum(pos + 1, last), keys[:, 0], temp, top_k, top_p, presence, frequency, repetition,
             counts, seen, bias)
    return (nxt, picked, top_values, top_ids.astype(jnp.int32)), state


def process(logits, allowed, presence, frequency, repetition, counts, seen, bias):
    """The logits processors of every slot, on the device (``[B, V]``): the repetition penalty over the
    tokens of the prompt and the reply (transformers' rule: divide, or multiply where negative), OpenAI's
    presence and frequency penalties over the reply's tokens, the logit bias, then the allowed-token
    bitmask (a disallowed token gets -inf)."""
    import jax.numpy as jnp
    vocab = logits.shape[-1]
    hit = seen | (counts > 0)
    # a penalty that float32 flushes to 0 (1e-40 is a legal value) would make 0 / 0: NaN, and the draw <pad>
    rep = jnp.maximum(repetition, jnp.finfo(jnp.float32).tiny)[:, None]
    x = jnp.where(hit, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    x = x - presence[:, None] * (counts > 0) - frequency[:, None] * counts.astype(jnp.float32) + bias
    ids = jnp.arange(vocab)
    bits = (allowed[:, ids // 32] >> (ids % 32).astype(jnp.int32)) & 1
    return jnp.where(bits != 0, x, -jnp.inf)


def mask_words(vocab: int) -> int:
    """The int32 words of a ``vocab``-token bitmask."""
    return (vocab + 31) // 32


def jit_set_row():
    """:func:`set_row` jitted, the state donated."""
    import jax
    return Prepared(jax.jit(set_row, donate_argnums=(0,)))


def jit_get_row():
    """``get_row(state, i) -> row``: state row ``i`` (int32), as :func:`jit_set_row` sets it (a copy)."""
    import jax
    return Prepared(jax.jit(_take))


def jit_insert():
    """:func:`insert_rows` jitted, the batch's state and caches donated."""
    import jax
    return Prepared(jax.jit(insert_rows, donate_argnums=(0, 1)))


def jit_zeros(rows: int | None, specs: list, shardings: tuple):
    """A jitted function making zero caches of ``rows`` rows (``specs``: each cache's row shape and dtype;
    with ``rows`` None each one's whole shape) where ``shardings`` says."""
    import jax
    lead = () if rows is None else (rows,)
    return Prepared(jax.jit(lambda: tuple(jax.numpy.zeros((*lead, *s), d) for s, d in specs),
                            out_shardings=shardings))


def put(x, sharding):
    """Host values (a tree of them) on the devices of ``sharding``; under several processes every process
    passes the same values (the steps are the same everywhere)."""
    import jax
    from ..runtimes.xla import place
    return jax.tree.map(lambda v: place(np.asarray(v), sharding)[0], x)


def cache_shardings(runner, cache_names: list[str], default) -> tuple:
    """The sharding of each cache input of ``runner``'s program (its plan's), or ``default``."""
    by_name = dict(zip([s.name for s in runner.inputs], runner.input_shardings or ()))
    return tuple(by_name.get(n, default) for n in cache_names)


def state_rows(slots: int, vocab: int):
    """The decode state of ``slots`` idle slots: next token, position, key, temperature, top-k, top-p,
    presence, frequency and repetition penalties, the reply's token counts ``[B, V]``, the prompt's tokens
    ``[B, V]`` (bool) and the logit bias ``[B, V]``."""
    return (np.zeros(slots, np.int32), np.zeros(slots, np.int32), np.zeros((slots, 2), np.uint32),
            np.zeros(slots, np.float32), np.zeros(slots, np.int32), np.ones(slots, np.float32),
            np.zeros(slots, np.float32), np.zeros(slots, np.float32), np.ones(slots, np.float32),
            np.zeros((slots, vocab), np.int32), np.zeros((slots, vocab), bool), np.zeros((slots, vocab), np.float32))


def state_row(params, prompt, seed: int, vocab: int) -> tuple:
    """One slot's decode state for a request entering the batch (see :func:`state_rows`)."""
    seen = np.zeros(vocab, bool)
    seen[np.asarray(prompt, np.int64)] = True
    bias = np.zeros(vocab, np.float32)
    for t, b in params.logit_bias:
        bias[t] += b
    return (np.int32(prompt[-1]), np.int32(len(prompt) - 1),
            np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32), np.float32(params.temperature),
            np.int32(params.top_k or 0), np.float32(1.0 if params.top_p is None else params.top_p),
            np.float32(params.presence_penalty), np.float32(params.frequency_penalty),
            np.float32(params.repetition_penalty), np.zeros(vocab, np.int32), seen, bias)


def set_row(state, slot, row):
    return tuple(s.at[slot].set(v) for s, v in zip(state, row))


def insert_rows(state, caches, slot_caches, slot, row):
    """A prefilled request into the batch: its state ``row`` and its own caches at slot ``slot``."""
    import jax
    state = tuple(s.at[slot].set(v) for s, v in zip(state, row))
    caches = tuple(jax.lax.dynamic_update_slice_in_dim(c, s, slot, axis=0) for c, s in zip(caches, slot_caches))
    return state, caches


def sample(logits, key, temperature, top_k, top_p):
    """The next token from ``logits [vocab]`` on the device: argmax at temperature 0, else a draw from
    the tempered distribution restricted to the ``top_k`` most likely tokens (0: all) and the smallest
    set whose probability reaches ``top_p``."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    # a tiny repetition penalty or temperature overflows the top logits to +inf, whose softmax is NaN: they
    # become the largest float (equal among themselves, as transformers' argmax sees them)
    scaled = jnp.where(jnp.isnan(scaled), -jnp.inf, jnp.minimum(scaled, jnp.finfo(jnp.float32).max))
    order = jnp.argsort(-scaled)
    ranked = scaled[order]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked)
    # the smallest prefix reaching top_p; the first always kept (a top_p that float32 flushes to 0 keeps it too)
    keep = ((jnp.cumsum(probs) - probs) < top_p) | (jnp.arange(vocab) == 0)
    filtered = jnp.full_like(scaled, -jnp.inf).at[order].set(jnp.where(keep, ranked, -jnp.inf))
    drawn = jax.random.categorical(key, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32))


def jit_page_store(page: int):
    """``store(pool, caches, row, src, dst) -> pool``, the pool donated: prefix caching's copy of cache row
    ``row``'s pages ``src[j]`` (page ``p`` holds positions ``[p * page, (p + 1) * page)`` of every KV cache
    ``[B, heads, C, dim]``) into pool pages ``dst[j]`` (each pool tensor ``[pages, heads, page, dim]``); a
    ``dst`` past the pool's end is no page (a fixed number of entries: one compiled call)."""
    import jax

    def store(pool, caches, row, src, dst):
        out = []
        for p, c in zip(pool, caches):
            r = jax.lax.dynamic_index_in_dim(c, row, axis=0, keepdims=False)  # [heads, C, dim]
            heads, length, dim = r.shape
            whole = length // page
            pages = r[:, :whole * page].reshape(heads, whole, page, dim).transpose(1, 0, 2, 3)
            out.append(p.at[dst].set(pages[src], mode="drop"))
        return tuple(out)
    return Prepared(jax.jit(store, donate_argnums=(0,)))


def jit_page_load(page: int, specs: list, shardings: tuple):
    """``load(pool, ids, count) -> caches``: one request's own caches (``specs``: each one's row shape
    ``(heads, C, dim)`` and dtype) holding pool pages ``ids[:count]`` at their first ``count * page``
    positions and zeros after them."""
    import jax

    def load(pool, ids, count):
        import jax.numpy as jnp
        out = []
        for p, (shape, dtype) in zip(pool, specs):
            heads, length, dim = shape
            got = p[jnp.clip(ids, 0, p.shape[0] - 1)]  # [n, heads, page, dim]
            n = got.shape[0]
            got = got.transpose(1, 0, 2, 3).reshape(heads, n * page, dim)
            keep = jnp.arange(n * page) < count * page
            got = jnp.where(keep[None, :, None], got, jnp.zeros((), got.dtype))
            out.append(jnp.zeros((1, heads, length, dim), dtype).at[0, :, :n * page].set(got.astype(dtype)))
        return tuple(out)
    return Prepared(jax.jit(load, out_shardings=shardings))
