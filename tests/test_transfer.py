"""State transfer (:mod:`unicron.runtime.transfer`): members of one real epoch group
(gloo, one thread each, on a TCPStore) stream the model and AdamW state to members without it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import unicron.runtime.transfer as transfer_module
from unicron.protocol import EpochInfo, epoch_info_key, epoch_key
from unicron.runtime import stateorder
from unicron.runtime.group import EpochGroup, EpochOver, EpochWatch
from unicron.runtime.transfer import (
    Spec,
    _Stream,
    decode,
    encode,
    fresh,
    layout,
    model_tensors,
    share,
    state_nbytes,
    state_tensors,
    transfer,
)

pytestmark = pytest.mark.e2e


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(40, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 7)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _model(seed)
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        model(torch.randn(5, 40, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _announce(store: dist.TCPStore, epoch: int, members: int, *, urgent: bool = False) -> None:
    info = EpochInfo(epoch, tuple(range(members)), (0,) * members, urgent)
    store.set(epoch_info_key("t", epoch), info.to_json())
    store.set(epoch_key("t"), str(epoch))


def _run_group(
    world: int, body: Callable[[EpochGroup], Any], *, supersede: bool = False
) -> list[Any]:
    """Run ``body(group)`` on ``world`` members of epoch 1 in threads; results by rank. With
    ``supersede``, a newer urgent epoch is announced 0.5 s after every member has met.

    Every member's group is built before any body runs: a body that returns at once ends its
    thread and frees its group, which closed the connections a slower member was still
    making in its constructor (on a loaded machine: "Connection closed by peer")."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _announce(master, 1, world)
    results: list[Any] = [None] * world
    built = threading.Barrier(world)
    met = threading.Semaphore(0)

    def member(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False)
        watch = EpochWatch(store, "t")
        g = EpochGroup(store, watch, watch.info(1), rank, slice_s=0.05, timeout_s=30.0)
        try:
            g.rendezvous()
            built.wait(timeout=30)
            met.release()
            results[rank] = body(g)
        except Exception as exc:  # reported to the test, not lost in the thread
            results[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    if supersede:  # once the members wait (a loaded machine may take a while to meet)
        for _ in range(world):
            met.acquire(timeout=30)
        time.sleep(0.5)
        _announce(master, 2, world, urgent=True)
    for t in threads:
        t.join(timeout=60)
    return results


def _same(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: Any) -> None:
    for x, y in zip(a[0].state_dict().values(), b[0].state_dict().values(), strict=True):
        assert torch.equal(x, y)
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agreed", [False, True])
@pytest.mark.parametrize("chunk", [64, 1000, 8192])
def test_two_holders_stream_the_state_to_a_joiner_and_it_trains_on_identically(
    chunk: int, agreed: bool
) -> None:
    """``agreed``: the joiner posts its model's receives before the manifest has arrived."""
    reference = _trained(seed=0, steps=3)
    members = [_trained(seed=0, steps=3), _model(seed=7), _trained(seed=0, steps=3)]

    def body(g: EpochGroup) -> Any:
        model, opt = members[g.rank]
        return transfer(g, model, opt, holders=[0, 2], needers=[1], device=torch.device("cpu"),
                        chunk_bytes=chunk, window=3, agreed=agreed)  # fmt: skip

    stats = _run_group(3, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])
    nbytes = state_nbytes(*reference)
    assert stats[1].nbytes == nbytes
    model_bytes = sum(t.numel() * t.element_size() for t in reference[0].state_dict().values())
    if model_bytes <= chunk:  # a model within one chunk comes from the first holder alone
        assert (stats[0].nbytes, stats[2].nbytes) == (nbytes, 0)
    else:  # each holder sent a share
        assert stats[0].nbytes + stats[2].nbytes == nbytes
        assert stats[0].nbytes > 0 and stats[2].nbytes > 0
    # the received optimizer state is live: one more step on both gives the same bits
    for model, opt in (reference, members[1]):
        model(torch.ones(2, 40)).sum().backward()
        opt.step()
    _same(reference, members[1])


@pytest.mark.timeout(60)
def test_a_second_transfer_in_an_epoch_reuses_the_subgroups_and_the_joiners_own_state() -> None:
    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model(torch.ones(2, 40)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    reference = _trained(seed=0, steps=2)
    step(*reference)
    members = [_trained(seed=0, steps=2), _model(seed=7), _trained(seed=0, steps=2)]
    moments: list[int] = []

    def body(g: EpochGroup) -> Any:
        model, opt = members[g.rank]
        kw: dict[str, Any] = {"holders": [0, 2], "needers": [1], "device": torch.device("cpu")}
        transfer(g, model, opt, chunk_bytes=500, **kw)
        if g.rank != 1:
            step(model, opt)  # the holders go on; the joiner must receive the new state
        else:
            moments.append(opt.state_dict()["state"][0]["exp_avg"].data_ptr())
        transfer(g, model, opt, chunk_bytes=500, **kw)
        if g.rank == 1:  # its optimizer state had the holders' shapes: written in place
            moments.append(opt.state_dict()["state"][0]["exp_avg"].data_ptr())
        return sorted(g.subgroups)

    subgroups = _run_group(3, body)
    assert not any(isinstance(s, Exception) for s in subgroups), subgroups
    _same(reference, members[1])
    assert subgroups[1] == ["transfer/0/0-1", "transfer/2/2-1"]  # built once each
    assert moments[0] == moments[1]


def test_a_chunk_inside_one_tensor_moves_in_place_and_small_tensors_are_packed() -> None:
    tensors = [torch.zeros(100), torch.zeros(3), torch.zeros(2), torch.zeros(1000)]
    s = _Stream(tensors, chunk=64)
    assert s.count == -(-(1105 * 4) // 64)
    assert s.view(0, torch.device("cpu")) is not None  # bytes 0..63 of the first tensor
    assert s.pieces(6) == [(0, 384, 400), (1, 0, 12), (2, 0, 8), (3, 0, 28)]
    assert s.view(6, torch.device("cpu")) is None
    assert [share(k, [4, 9]) for k in range(4)] == [4, 9, 4, 9]


def test_the_manifest_goes_through_json_and_back_unchanged() -> None:
    skeleton = {
        "model": {"w": Spec((3, 4), torch.float32), "b": Spec((), torch.bfloat16)},
        "optim": {
            "state": {0: {"step": Spec((), torch.float32), "exp_avg": Spec((0, 2), torch.int64)}},
            "param_groups": [
                {"betas": (0.9, 0.999), "lr": 1e-3, "eps": -0.0, "amsgrad": False, "n": 1,
                 "foreach": None, "name": "decoder", "params": [0, 1], "clip": float("inf")}
            ],
        },
    }  # fmt: skip
    back = decode(encode(skeleton))
    assert back == skeleton
    group = back["optim"]["param_groups"][0]
    assert type(group["betas"]) is tuple and type(group["amsgrad"]) is bool
    assert type(group["n"]) is int and str(group["eps"]) == "-0.0"
    assert list(back["optim"]["state"]) == [0]  # an integer key stays an integer
    nan = decode(encode({"x": float("nan")}))["x"]
    assert nan != nan
    # the state of a real optimizer: its manifest decodes to the same skeleton
    model, opt = _trained(seed=0, steps=1)
    real, _ = state_tensors(model, opt)
    assert decode(encode(real)) == real
    with pytest.raises(TypeError, match="holds a object"):
        encode({"x": object()})


def test_fresh_optimizer_state_is_one_buffer_in_stream_order_and_lands_in_place() -> None:
    specs = [
        Spec((5,), torch.bfloat16),  # 10 bytes
        Spec((), torch.float32),  # the next offset a float32 may take: 12 (a gap of 2)
        Spec((2, 3), torch.float32),
        Spec((7,), torch.float32),
    ]
    ts = fresh(specs, torch.device("cpu"))
    assert [(tuple(t.shape), t.dtype) for t in ts] == [(s.shape, s.dtype) for s in specs]
    assert len({t.untyped_storage().data_ptr() for t in ts}) == 1
    base = ts[0].data_ptr()
    assert [t.data_ptr() - base for t in ts] == [0, 12, 16, 40]
    s = _Stream(ts, chunk=20)  # stream bytes 0-9, 10-13, 14-37, 38-65
    assert s.view(0, torch.device("cpu")) is None  # spans the gap after the bfloat16s
    span = s.view(1, torch.device("cpu"))  # bytes 20..39: inside the last two, which touch
    assert span is not None and span.numel() == 20
    span.copy_(torch.arange(20, dtype=torch.uint8))
    assert ts[2].reshape(-1).view(torch.uint8).tolist()[6:] == list(range(18))
    assert ts[3].reshape(-1).view(torch.uint8).tolist()[:2] == [18, 19]
    other = [torch.zeros(6), torch.zeros(7)]  # separate allocations are never one span
    assert _Stream(other, chunk=32).view(0, torch.device("cpu")) is None
    # the optimizer's state starts a chunk, so that a needer's fresh buffer takes it in place
    model = [torch.zeros(3)]  # 12 bytes
    s = _Stream(model + ts, chunk=32, breaks=(1,))
    assert s.bounds == [(0, 12), (12, 44), (44, 76), (76, 78)]
    assert s.view(0, torch.device("cpu")) is not None  # the model's one tensor
    assert s.view(1, torch.device("cpu")) is None  # the bfloat16s, the gap, the scalar, ...
    assert s.view(2, torch.device("cpu")) is not None  # inside the last two, which touch
    assert s.size(3) == 2
    assert _Stream(other, chunk=32).view(0, torch.device("cpu")) is None


@pytest.mark.timeout(60)
def test_one_holder_streams_to_two_joiners_over_the_epochs_own_group() -> None:
    reference = _trained(seed=0, steps=2)
    members = [_trained(seed=0, steps=2), _model(seed=5), _model(seed=6)]

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1, 2],
                        device=torch.device("cpu"), chunk_bytes=1000)  # fmt: skip

    stats = _run_group(3, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])
    _same(reference, members[2])
    assert stats[0].nbytes == 2 * state_nbytes(*reference)  # one share per joiner


@pytest.mark.timeout(60)
def test_a_member_neither_holder_nor_needer_takes_no_part() -> None:
    """Rank 1 (say a holder on another node than the joiner) returns at once, before the
    others have done anything; the joiner gets the state from rank 0 over the epoch's own
    group, point to point: no group of the two is built."""
    reference = _trained(seed=0, steps=2)
    members = [_trained(seed=0, steps=2), _trained(seed=0, steps=2), _model(seed=4)]
    started = threading.Event()

    def body(g: EpochGroup) -> Any:
        if g.rank == 1:
            stats = transfer(g, *members[1], holders=[0], needers=[2], device=torch.device("cpu"))
            started.set()
            return stats, sorted(g.subgroups), sorted(g.peers)
        assert started.wait(10)  # rank 1 never waited for them
        stats = transfer(g, *members[g.rank], holders=[0], needers=[2],
                         device=torch.device("cpu"), chunk_bytes=1000)  # fmt: skip
        return stats, sorted(g.subgroups), sorted(g.peers)

    results = _run_group(3, body)
    assert not any(isinstance(r, Exception) for r in results), results
    stats = [r[0] for r in results]
    assert stats[1].nbytes == 0
    _same(reference, members[2])
    assert stats[0].nbytes == stats[2].nbytes == state_nbytes(*reference)
    assert [r[1:] for r in results] == [([], [2]), ([], []), ([], [0])]


def _peer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("unicron-peer-")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frozen", ["holder", "needer"])
def test_a_pair_over_the_epochs_group_leaves_a_superseded_epoch_at_once(frozen: str) -> None:
    """One holder (rank 0) and one needer (rank 2) of three, point to point: the ``frozen``
    one never takes part; the other waits for it in slices (a point-to-point wait cannot be
    left in slices by itself: its waiter thread waits, the caller watches the epoch) and
    leaves when epoch 2 is announced, not at the 30 s group timeout. Its waiter thread ends
    once the group is left and the frozen member's connection is gone."""
    members = [_trained(seed=0, steps=1), _trained(seed=0, steps=1), _model(seed=3)]
    waiting = 2 if frozen == "holder" else 0
    before = _peer_threads()
    left = threading.Event()

    def body(g: EpochGroup) -> Any:
        if g.rank == 2 - waiting:  # frozen: alive, its connections open, until the other left
            return left.wait(20)
        if g.rank != waiting:
            return None  # the bystander
        t0 = time.monotonic()
        try:
            with pytest.raises(EpochOver):
                transfer(g, *members[g.rank], holders=[0], needers=[2],
                         device=torch.device("cpu"))  # fmt: skip
        finally:
            g.leave()
            left.set()
        return time.monotonic() - t0, sorted(g.subgroups)

    results = _run_group(3, body, supersede=True)
    assert isinstance(results[waiting], tuple), results
    seconds, subgroups = results[waiting]
    assert seconds < 5.0  # announced after ~0.5 s; sliced waits of 0.05 s
    assert subgroups == []
    deadline = time.monotonic() + 20
    while len(_peer_threads()) > len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_peer_threads()) == len(before)


@pytest.mark.timeout(60)
def test_a_receiver_leaves_a_superseded_epoch_at_once() -> None:
    """Rank 0 holds the state but never sends (as if frozen); rank 1 waits for it in slices
    and leaves when epoch 2 is announced, not at the 30 s group timeout."""
    holder, joiner = _trained(seed=0, steps=1), _model(seed=3)

    def body(g: EpochGroup) -> Any:
        if g.rank == 0:
            return None  # never takes part
        t0 = time.monotonic()
        with pytest.raises(EpochOver):
            transfer(g, *joiner, holders=[0], needers=[1], device=torch.device("cpu"))
        return time.monotonic() - t0

    results = _run_group(2, body, supersede=True)
    assert isinstance(results[1], float), results
    assert results[1] < 5.0  # announced after ~0.5 s; sliced waits of 0.05 s
    del holder


def test_the_first_chunks_of_each_part_ramp_up_to_the_chunk_size() -> None:
    model = [torch.zeros(100)]  # 400 bytes
    optim = [torch.zeros(50), torch.zeros(60)]  # 440 bytes
    s = _Stream(model + optim, chunk=128, breaks=(1,), ramp=4)
    assert s.bounds == [
        (0, 32), (32, 96), (96, 224), (224, 352), (352, 400),  # 32, 64, 128, 128, the rest
        (400, 432), (432, 496), (496, 624), (624, 752), (752, 840),
    ]  # fmt: skip
    assert _Stream(model + optim, chunk=128, breaks=(1,)).bounds[:2] == [(0, 128), (128, 256)]


@pytest.mark.timeout(60)
def test_staging_buffers_come_from_the_pool_and_go_back_to_it() -> None:
    """The small tensors of this model go through staging buffers on both sides; those of a
    transfer are the pool's (touched once, at warm-up, not page-faulted in every transfer)."""
    transfer_module.warm_up(torch.device("cpu"), slots=8, nbytes=4096)
    pooled = {b.data_ptr() for b in transfer_module._POOL}
    assert len(pooled) >= 8
    reference = _trained(seed=0, steps=2)
    members = [_trained(seed=0, steps=2), _model(seed=7)]
    taken: list[int] = []
    take = transfer_module._take

    def spy(wire: torch.device, nbytes: int) -> torch.Tensor:
        buf = take(wire, nbytes)
        taken.append(buf.data_ptr())
        return buf

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"), chunk_bytes=4096, window=2)  # fmt: skip

    transfer_module._take = spy
    try:
        stats = _run_group(2, body)
    finally:
        transfer_module._take = take
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])
    assert stats[0].packed > 0 and stats[1].packed > 0
    assert taken and set(taken) <= pooled  # nothing allocated during the transfer
    assert set(taken) <= {b.data_ptr() for b in transfer_module._POOL}  # and given back


class _CopyingAdamW(torch.optim.AdamW):
    """An optimizer whose ``load_state_dict`` keeps copies of the tensors it is given (as
    torch's optimizers do when a state's dtype or device differs from its parameter's)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        copied = {
            "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in s.items()} for i, s in state_dict["state"].items()},
            "param_groups": state_dict["param_groups"],
        }  # fmt: skip
        super().load_state_dict(copied)


@pytest.mark.timeout(60)
def test_an_optimizer_that_copies_what_it_loads_gets_the_received_state() -> None:
    """The needer hands its optimizer the received tensors while they are on the wire; an
    optimizer that copied them then is given them again once they have landed."""
    reference = _trained(seed=0, steps=2)
    torch.manual_seed(7)
    joiner_model = torch.nn.Sequential(
        torch.nn.Linear(40, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 7)
    )
    joiner = (joiner_model, _CopyingAdamW(joiner_model.parameters(), lr=1e-2))
    members = [_trained(seed=0, steps=2), joiner]

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"), chunk_bytes=512)  # fmt: skip

    stats = _run_group(2, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, joiner)


@pytest.mark.timeout(60)
def test_a_holder_whose_optimizer_has_no_state_yet_sends_the_model_alone() -> None:
    reference = _model(seed=0)
    members = [_model(seed=0), _model(seed=7)]

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"), chunk_bytes=256)  # fmt: skip

    stats = _run_group(2, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])
    assert members[1][1].state_dict()["state"] == {}


@pytest.mark.timeout(60)
def test_warm_up_rehearses_a_whole_transfer_between_two_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first-use costs of a process's first transfer are paid when the worker starts: a
    tiny model's state crosses a gloo group of two threads of this process, intact, and the
    process's random stream is left as it was."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert transfer_module.rehearse()
    assert torch.equal(torch.rand(3), expected)
    calls: list[int] = []
    monkeypatch.setattr(transfer_module, "rehearse", lambda: calls.append(1) or True)
    transfer_module.warm_up(torch.device("cpu"), slots=1, nbytes=64)
    assert calls == [1]


class _Tied(torch.nn.Module):
    """A tied weight (listed twice in the state dict), a buffer, and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x))) * self.scale


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(n):
        model(torch.randint(0, 11, (4, 5), generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_laying_the_state_out_in_stream_order_changes_no_value_and_no_step() -> None:
    torch.manual_seed(0)
    model = _Tied()
    twin = _Tied()
    twin.load_state_dict(model.state_dict())
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    assert transfer_module.lay_out_parameters(model)
    assert list(model.parameters()) == params  # the same parameter objects, moved
    assert model.head.weight is model.emb.weight
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert not transfer_module.lay_out_optimizer_state(opt)  # no state before a step
    _steps(model, opt, 1)
    _steps(twin, twin_opt, 1)
    assert transfer_module.lay_out_optimizer_state(opt)
    # three storages: the parameters, the buffer, the optimizer's state (its step counts too)
    tensors = state_tensors(model, opt)[1]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 3
    moments: list[torch.Tensor] = []
    transfer_module._tensors(opt.state_dict(), moments)
    assert stateorder._in_order(moments)  # in stream order
    before = [p.data_ptr() for p in params]
    assert transfer_module.lay_out_parameters(model)  # already laid out: nothing moves
    assert [p.data_ptr() for p in params] == before
    _steps(model, opt, 3)
    _steps(twin, twin_opt, 3)
    _same((twin, twin_opt), (model, opt))  # bit for bit


def test_a_parameter_that_shares_memory_keeps_its_place() -> None:
    model = torch.nn.Linear(4, 4)
    model.extra = torch.nn.Parameter(model.weight.data[0])  # a view of the weight
    where = [p.data_ptr() for p in model.parameters()]
    assert not transfer_module.lay_out_parameters(model)
    assert [p.data_ptr() for p in model.parameters()] == where


@pytest.mark.timeout(60)
def test_a_laid_out_state_moves_in_place_on_both_sides() -> None:
    reference = _trained(seed=0, steps=2)
    members = [_trained(seed=0, steps=2), _model(seed=5)]
    for model, opt in [reference, *members]:
        transfer_module.lay_out_parameters(model)
        transfer_module.lay_out_optimizer_state(opt)

    def body(g: EpochGroup) -> Any:  # a window of 1 holds back packed chunks only
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"), chunk_bytes=1000, window=1)  # fmt: skip

    stats = _run_group(2, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])
    assert stats[1].chunks > 4
    assert stats[0].packed == 0 and stats[1].packed == 0, stats  # no staging copy


def test_a_parameter_aliased_by_a_buffer_keeps_its_place() -> None:
    model = torch.nn.Linear(4, 4)
    model.register_buffer("mirror", model.bias.data)  # the same memory as the bias
    where = [p.data_ptr() for p in model.parameters()]
    assert not transfer_module.lay_out_parameters(model)
    assert [p.data_ptr() for p in model.parameters()] == where
    assert model.mirror.data_ptr() == model.bias.data_ptr()


class _Many(torch.nn.Module):
    """A model of many small tensors: its manifest is longer than the manifest's head."""

    def __init__(self, n: int, width: int = 2) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.ps)  # type: ignore[return-value]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("agreed", [False, True])
def test_a_manifest_longer_than_its_head_arrives_whole(agreed: bool, world: int) -> None:
    """The rest of a long manifest is a second broadcast: before the chunks, or, when the
    joiner posts its model's receives first (``agreed``), after the model's chunks. With a
    third member (taking no part), holder and joiner send and receive point to point over
    the epoch's group, in the same order."""

    def build(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = _Many(700)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            model(torch.ones(2)).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    reference = build(0, 2)
    members = [build(0, 2), build(1, 0), build(0, 2)][:world]
    data = transfer_module.inventory(model_tensors(reference[0]), reference[1], manifest=True)
    assert data.manifest is not None and len(data.manifest) > transfer_module.MANIFEST_HEAD

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"), chunk_bytes=2000, agreed=agreed)  # fmt: skip

    stats = _run_group(world, body)
    assert not any(isinstance(s, Exception) for s in stats), stats
    _same(reference, members[1])


def test_the_layout_digest_tells_models_apart_by_shapes_and_dtypes_only() -> None:
    a, b = _model(seed=1)[0], _model(seed=2)[0]
    assert layout(model_tensors(a)) == layout(model_tensors(b))  # other values, one layout
    wider = torch.nn.Sequential(
        torch.nn.Linear(40, 31), torch.nn.LayerNorm(31), torch.nn.Linear(31, 7)
    )
    assert layout(model_tensors(wider)) != layout(model_tensors(a))
    assert layout(model_tensors(a.double())) != layout(model_tensors(b))
    assert 0 <= layout(model_tensors(a)) < 2**63  # fits the ledger's int64 row


@pytest.mark.timeout(60)
def test_a_joiner_whose_model_differs_gets_a_clear_error_not_a_crash() -> None:
    """Without an agreed layout the joiner posts nothing before the manifest: a model of
    other shapes is refused with the tensor named (a receive of the wrong size would abort
    the process in gloo: the joiner's model is the smaller, so the holder's first chunk would
    overrun a receive posted from it); the holder leaves when a newer epoch is announced."""
    holder = _trained(seed=0, steps=1)
    torch.manual_seed(3)
    narrower = torch.nn.Sequential(
        torch.nn.Linear(40, 29), torch.nn.LayerNorm(29), torch.nn.Linear(29, 7)
    )
    joiner = (narrower, torch.optim.AdamW(narrower.parameters()))
    members = [holder, joiner]

    def body(g: EpochGroup) -> Any:
        return transfer(g, *members[g.rank], holders=[0], needers=[1],
                        device=torch.device("cpu"))  # fmt: skip

    results = _run_group(2, body, supersede=True)
    assert isinstance(results[1], RuntimeError), results
    assert "differs from the holder's (tensor 0: (29,) torch.float32, holder (30,)" in str(
        results[1]
    )
    assert isinstance(results[0], EpochOver), results


def test_a_state_the_manifest_cannot_describe_fails_only_the_transfer_that_needs_it() -> None:
    """The worker takes every member's inventory at every ledger exchange: a state with a
    value JSON cannot carry must not stop a transition that moves no state."""
    model, opt = _trained(seed=0, steps=1)
    opt.param_groups[0]["schedule"] = object()
    have = transfer_module.inventory(model_tensors(model), opt, manifest=True)
    assert have.manifest is None
    assert len(have.optim) == 3 * len(list(model.parameters()))  # AdamW: step and moments
    with pytest.raises(TypeError, match="holds a object"):
        transfer_module._manifest(have.model, opt)
