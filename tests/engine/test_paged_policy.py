"""The paged engine's scheduling policy (engine/paged_policy.py) without a device: admission while the pool
holds a prompt, pages taken as sequences grow, preemption of the last to arrive when the pool runs short, and
prefix pages shared. A stand-in runner plays the device's part (it saves a preempted row's state and
"samples" the next token); the loop is the paged engine's step with the device calls taken out."""
import collections
import subprocess
import sys

from torchtpu_export.engine.paged_policy import PagedPolicy
from torchtpu_export.engine.prefix import PagePool
from torchtpu_export.engine.request import Request, SamplingParams

PAGE = 4


class FakeRunner:
    """The device's part: a decoding row's next token is the request's id and the position it writes (so a
    resumed request's tokens show whether it went on from where it was); a saved state is that position."""

    def __init__(self, policy):
        self.policy, self.saved = policy, []

    def save(self, i: int):
        row = self.policy.rows[i]
        self.saved.append(row.request.id)
        return ("position", row.position)

    def token(self, row) -> int:
        return 1000 * row.request.id + row.position


def _policy(slots: int, pages: int, max_pages: int, prefix: bool = True):
    waiting = collections.deque()

    def next_waiting():
        return waiting[0] if waiting else None
    stats = {"prefix_hit_tokens": 0, "most_pages_in_use": 0, "preemptions": 0}
    policy = PagedPolicy(slots, PagePool(pages, PAGE, prefix, stats), max_pages, stats, waiting, next_waiting)
    return policy, waiting, stats


def _step(policy, runner) -> None:
    """One step: admit, make room, prefill every filling row whole (a chunk the size of its prompt), then one
    decode step of the decoding rows; a request ends at its max_new_tokens."""
    policy.admit()
    busy = policy.room(policy.decoding(), runner.save)
    for row in policy.rows:
        if row.request is not None and not row.decoding:
            policy.grow(row, len(row.seq) - 1)
            row.filled = len(row.seq) - 1
            if row.request.resume is not None:  # a preempted request goes on from its saved position
                (_, position), row.request.resume = row.request.resume[1], None
                assert position == len(row.seq) - 1
            policy.activated(row)
    busy = policy.room(policy.decoding(), runner.save)
    table = policy.decode_table(busy)
    for i in busy:
        row = policy.rows[i]
        assert all(p != 0 for p in table[i, :len(row.pages)]) and len(row.pages) * PAGE > row.position
        row.request.tokens.append(runner.token(row))
        row.position += 1
        if len(row.request.tokens) == row.request.params.max_new_tokens:
            row.request.finish("length")
            policy.release(i)


def _pages_are_owned_once(policy) -> None:
    """A page a live row writes (past its shared prefix) belongs to it alone, and page 0 to nobody."""
    written = collections.Counter()
    for row in policy.rows:
        if row.request is not None:
            shared = len(row.keys) if row.decoding else 0
            written.update(row.pages[shared:])
            assert 0 not in row.pages
    assert all(n == 1 for n in written.values()), written


def test_requests_wait_for_pages_first_come_first_served():
    policy, waiting, _ = _policy(slots=4, pages=5, max_pages=4)  # 4 usable pages
    big, small = Request(list(range(1, 14)), SamplingParams(2)), Request([1, 2, 3], SamplingParams(2))
    waiting.extend([big, small])
    policy.admit()
    # the big prompt takes 4 pages (13 tokens): the small one behind it waits, though a row is free
    assert [r.request for r in policy.rows if r.request] == [big] and list(waiting) == [small]
    assert policy.pool.reserved == 4 and policy.pool.available() == 0


def test_preempted_requests_go_on_from_where_they_were_and_every_request_ends():
    policy, waiting, stats = _policy(slots=3, pages=9, max_pages=4)  # 8 pages: not enough for 3 long sequences
    runner = FakeRunner(policy)
    requests = [Request([7, 8, 9, 10, 11], SamplingParams(10)) for _ in range(3)]
    waiting.extend(requests)
    for _ in range(200):
        if all(r.done for r in requests):
            break
        _step(policy, runner)
        _pages_are_owned_once(policy)
    assert all(r.finish_reason == "length" for r in requests)
    assert stats["preemptions"] > 0 and runner.saved  # the pool ran short, the last to arrive gave way
    for r in requests:  # each token at the position it would have had without preemption
        assert r.tokens == [1000 * r.id + p for p in range(4, 14)], r.tokens
    assert policy.pool.in_use() == 0 and policy.pool.reserved == 0 and stats["most_pages_in_use"] <= 8


def test_a_prompt_starting_with_a_finished_prompt_s_pages_reads_them_in_place():
    policy, waiting, stats = _policy(slots=2, pages=9, max_pages=4)
    runner = FakeRunner(policy)
    first = Request(list(range(1, 10)), SamplingParams(1))
    waiting.append(first)
    while not first.done:
        _step(policy, runner)
    pages = policy.pool.cached()
    assert pages == 2  # its full prompt pages (8 of its 9 tokens) stay, held by none
    second = Request(list(range(1, 10)) + [42], SamplingParams(1))
    waiting.append(second)
    policy.admit()
    row = next(r for r in policy.rows if r.request is second)
    assert row.filled == 2 * PAGE and stats["prefix_hit_tokens"] == 2 * PAGE


def test_the_policy_runs_without_jax():
    code = ("import sys; import torchtpu_export.engine.paged_policy; "
            "print('jax' in sys.modules, 'jaxlib' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], (r.stdout, r.stderr[-2000:])
