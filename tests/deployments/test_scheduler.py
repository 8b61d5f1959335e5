"""The pack scheduler without Ray: when packs close, cancellation, backpressure, failures.

Every test runs on a virtual clock (`run_virtual`, the scheduler's `clock`): its sleeps and the
scheduler's waits take no wall time and end in the order of their virtual times, on any machine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.router.scheduler import Overloaded, PackScheduler, QueuedItem, packs_in_flight
from models.protocol import ItemOutput, ItemSpec
from tests.virtual_clock import run_virtual


def spec(tokens: int, modality: str = "image", frames: int = 1) -> ItemSpec:
    side = int((tokens * 4 // frames) ** 0.5)
    return ItemSpec(modality, (frames, side, (tokens * 4 // frames) // side), tokens * 4, tokens)


class Recorder:
    """A dispatch that records packs (and the clock's time each was sent at) and answers each item
    with its own token count."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.packs: list[list[QueuedItem]] = []
        self.sent_at: list[float] = []
        self.delay_s, self.fail = delay_s, fail
        self.sent = asyncio.Event()

    async def __call__(self, modality, items):
        self.packs.append(items)
        self.sent_at.append(asyncio.get_running_loop().time())
        self.sent.set()
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("replica died")
        return [ItemOutput(tokens=torch.full((i.spec.output_tokens, 1), float(i.spec.output_tokens))) for i in items]


def scheduler(dispatch, max_wait_s=0.05, **kwargs) -> PackScheduler:
    options = dict(ladder=(64, 256, 1024), max_items=8, max_segments=16, target_fill=0.9, max_queued_tokens=10_000)
    options.update(kwargs)
    return PackScheduler(dispatch=dispatch, max_wait_s=max_wait_s, clock=asyncio.get_running_loop().time, **options)


def items(tokens: list[int], request_id: str, modality: str = "image") -> list[QueuedItem]:
    loop = asyncio.get_running_loop()
    return [
        QueuedItem(torch.zeros(1), spec(t, modality), request_id, loop.create_future(), enqueued_at=loop.time())
        for t in tokens
    ]


def test_items_of_several_requests_share_a_pack_and_get_their_own_outputs():
    async def main():
        recorder = Recorder()
        sched = scheduler(recorder)
        a, b = items([100, 40], "a"), items([70], "b")
        sched.submit(a)
        sched.submit(b)
        outputs = await asyncio.gather(*(i.future for i in a + b))
        return recorder, sched, outputs

    recorder, sched, outputs = run_virtual(main())
    assert len(recorder.packs) == 1 and len(recorder.packs[0]) == 3
    assert [o.tokens.shape[0] for o in outputs] == [100, 40, 70]
    assert sched.stats.snapshot()["mean_requests_per_pack"] == 2.0


def test_a_partial_pack_waits_max_wait_only_while_another_pack_is_in_flight():
    """Work-conserving: with nothing in flight a lone item leaves at once; while a pack is in flight
    a partial one waits `max_wait_s` for company, and a full one leaves at once."""

    async def main():
        recorder = Recorder(delay_s=2.0)
        sched = scheduler(recorder, max_wait_s=0.3)
        loop = asyncio.get_running_loop()

        async def sent_after(submitted: list[QueuedItem]) -> float:
            start = loop.time()
            recorder.sent.clear()
            sched.submit(submitted)
            await recorder.sent.wait()
            return recorder.sent_at[-1] - start

        lone = await sent_after(items([10], "lone"))
        partial = await sent_after(items([10], "partial"))
        full = await sent_after(items([950], "full"))  # >= 0.9 * 1024
        return lone, partial, full

    lone, partial, full = run_virtual(main())
    assert lone == 0 and full == 0
    assert partial == pytest.approx(0.3, abs=1e-5)


def test_cancelled_items_are_dropped_before_their_pack_is_sent():
    async def main():
        recorder = Recorder()
        sched = scheduler(recorder, max_wait_s=0.1)
        gone, kept = items([30, 30], "gone"), items([20], "kept")
        sched.submit(gone)
        sched.submit(kept)
        for item in gone:
            item.future.cancel()  # the client went away
        await kept[0].future
        return recorder, sched

    recorder, sched = run_virtual(main())
    assert [[i.request_id for i in p] for p in recorder.packs] == [["kept"]]
    assert sched.stats.dropped_cancelled == 2


def test_a_sent_pack_is_withdrawn_once_every_request_in_it_left_and_only_then():
    """A dispatch cancelled mid-flight is what tells the encoder replica to drop the pack."""

    async def main():
        cancelled = []

        async def dispatch(modality, pack):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                cancelled.append([i.request_id for i in pack])
                raise
            return [ItemOutput(tokens=torch.zeros(i.spec.output_tokens, 1)) for i in pack]

        sched = scheduler(dispatch, max_wait_s=0.01)
        gone, left = items([30], "gone"), items([20], "left")
        sched.submit(gone + left)  # one pack of two requests
        await asyncio.sleep(0.05)  # sent
        gone[0].future.cancel()
        await asyncio.sleep(0.05)
        one_left = list(cancelled)
        left[0].future.cancel()
        await asyncio.sleep(0.05)
        return one_left, list(cancelled), sched.stats.abandoned_packs, sched.stats.failed_packs

    one_left, cancelled, abandoned, failed = run_virtual(main())
    assert one_left == [] and cancelled == [["gone", "left"]]
    assert abandoned == 1 and failed == 0


def test_modalities_never_share_a_pack_and_oldest_goes_first():
    async def main():
        recorder = Recorder()
        sched = scheduler(recorder, max_wait_s=0.05)
        video = items([50], "v", modality="video")
        image = items([50], "i")
        sched.submit(video)
        sched.submit(image)
        await asyncio.gather(video[0].future, image[0].future)
        return recorder

    recorder = run_virtual(main())
    assert [[i.spec.modality for i in p] for p in recorder.packs] == [["video"], ["image"]]


def test_queued_tokens_are_bounded():
    async def main():
        sched = scheduler(Recorder(delay_s=0.2), max_queued_tokens=500, max_wait_s=0.0)
        first = items([400], "first")
        sched.submit(first)
        with pytest.raises(Overloaded, match="max_queued_tokens=500"):
            sched.submit(items([200], "second"))
        await first[0].future
        sched.submit(items([200], "third"))  # room again once the first is done

    run_virtual(main())


def test_a_failing_item_fails_only_its_own_request_and_the_split_keeps_one_pack_in_flight():
    """A pack that fails for an item's sake is rerun in halves, one after the other: the others
    still succeed, and the router's slot never holds more than the one pack it was given."""

    class Poisoned(Recorder):
        def __init__(self):
            super().__init__()
            self.inflight = self.most_inflight = 0

        async def __call__(self, modality, items):
            self.packs.append(items)
            self.inflight += 1
            self.most_inflight = max(self.most_inflight, self.inflight)
            try:
                await asyncio.sleep(0.01)
                if any(i.request_id == "poison" for i in items):
                    raise ValueError("bad item")
                return [ItemOutput(tokens=torch.zeros(i.spec.output_tokens, 1)) for i in items]
            finally:
                self.inflight -= 1

    async def main():
        recorder = Poisoned()
        sched = scheduler(recorder, max_wait_s=0.05)
        good, bad, more = items([10, 20], "good"), items([30], "poison"), items([40, 50, 60], "more")
        for request in (good, bad, more):
            sched.submit(request)
        results = await asyncio.gather(*(i.future for i in good + bad + more), return_exceptions=True)
        return sched, recorder, results

    sched, recorder, results = run_virtual(main())
    assert len(recorder.packs[0]) == 6  # one pack of all three requests, which failed
    assert [r.tokens.shape[0] for i, r in enumerate(results) if i != 2] == [10, 20, 40, 50, 60]
    assert isinstance(results[2], ValueError)
    assert recorder.most_inflight == 1
    # halves of 6, then of the failing 3, then of its failing 1 + 1: 3 splits, 7 packs in all
    assert sched.stats.split_packs == 3 and len(recorder.packs) == 7
    assert sched.queued_tokens == 0


class ReplicaDied(Exception):
    pass


def test_a_pack_whose_replica_died_is_resent_once():
    class DiesOnce(Recorder):
        async def __call__(self, modality, items):
            if not self.packs:
                self.packs.append(items)
                raise ReplicaDied()
            return await super().__call__(modality, items)

    async def main():
        sched = scheduler(DiesOnce(), max_wait_s=0.0, retries=1, retryable=lambda e: isinstance(e, ReplicaDied))
        batch = items([10, 20], "x")
        sched.submit(batch)
        return sched, await asyncio.gather(*(i.future for i in batch))

    sched, outputs = run_virtual(main())
    assert [o.tokens.shape[0] for o in outputs] == [10, 20]
    assert sched.stats.retried_packs == 1


def test_a_pack_that_keeps_failing_fails_with_the_final_error():
    async def main():
        sched = scheduler(
            Recorder(fail=True),
            max_wait_s=0.0,
            retries=1,
            retryable=lambda e: isinstance(e, RuntimeError),
            final_error=lambda error, retried: ConnectionError(f"gave up (retried={retried})"),
        )
        batch = items([10, 20], "x")
        sched.submit(batch)
        results = await asyncio.gather(*(i.future for i in batch), return_exceptions=True)
        return sched, results

    sched, results = run_virtual(main())
    assert all(isinstance(r, ConnectionError) and "retried=True" in str(r) for r in results)
    assert sched.stats.retried_packs == 1 and sched.stats.failed_packs == 2 and sched.queued_tokens == 0


def test_packs_do_not_run_in_the_submitting_requests_context():
    """A pack carries many requests' items: it must not inherit one request's context (Serve metadata)."""
    import contextvars

    request = contextvars.ContextVar("request", default=None)
    seen = []

    class Recording(Recorder):
        async def __call__(self, modality, items):
            seen.append(request.get())
            return await super().__call__(modality, items)

    async def main():
        sched = scheduler(Recording(), max_wait_s=0.0)
        request.set("first request")
        batch = items([10], "x")
        sched.submit(batch)
        await batch[0].future

    run_virtual(main())
    assert seen == [None]


def test_packs_wait_for_a_free_replica_slot_and_grow_meanwhile():
    """With one slot in flight, requests that arrive while a pack runs go out together in the next
    pack, not one pack each queued behind it at the replica."""

    async def main():
        release = asyncio.Event()

        class Gate(Recorder):
            async def __call__(self, modality, items):
                self.packs.append(items)
                await release.wait()
                return [ItemOutput(tokens=torch.zeros(i.spec.output_tokens, 1)) for i in items]

        gate = Gate()
        sched = scheduler(gate, max_wait_s=0.0, max_inflight_packs=lambda: 1)
        first = items([10], "first")
        sched.submit(first)
        await asyncio.sleep(0.05)  # the first pack is in flight, holding the only slot
        later = [items([10], f"r{n}") for n in range(5)]
        for request in later:
            sched.submit(request)
            await asyncio.sleep(0.01)
        assert len(gate.packs) == 1  # held: no slot
        release.set()
        await asyncio.gather(*(i.future for request in [first, *later] for i in request))
        return gate, sched

    gate, sched = run_virtual(main())
    assert [len({i.request_id for i in pack}) for pack in gate.packs] == [1, 5]
    assert sched.stats.held_for_room >= 1


def test_routers_together_keep_no_more_packs_in_flight_than_the_replicas_take():
    """Per router: `per_replica` for each running replica, capped by its share of the replicas'
    slots, at least one. 16 routers, 2 replicas of 8 slots: 1 each, not 4 (64 against 16 slots)."""
    assert packs_in_flight(running=1, per_replica=2, slots=None, routers=4) == 2  # slots not known yet
    assert packs_in_flight(running=1, per_replica=2, slots=8, routers=4) == 2
    assert packs_in_flight(running=2, per_replica=2, slots=16, routers=16) == 1
    assert packs_in_flight(running=4, per_replica=2, slots=32, routers=16) == 2
    assert packs_in_flight(running=1, per_replica=2, slots=8, routers=20) == 1  # never 0
    assert packs_in_flight(running=0, per_replica=2, slots=None, routers=1) == 2  # before the first reading
