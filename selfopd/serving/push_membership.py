"""Which servers a weight push reaches, step by step: the part of `WeightTransfer` that lets a run
outlive a dead server.

Each push first asks each server which processes answer at its URL (`_reroute`). A server reached
through several URLs (a proxy, a `self` teacher on a student's server) is sent the weights through
the first that reaches it, the collective unchanged. A server no URL reaches is left out, and the
groups are reopened without it (`_reopen`: a collective's ranks are fixed when it opens). A server left out whose URL answers
again (restarted, or reachable again) joins back, and that push is verified whatever
`verify_every` says. `holds` tells an engine whether a URL it dropped now reaches a server whose
last push was verified: only then does the engine put it back in its rotation
(`VLLMEngine.readmit`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from selfopd.serving.liveness import HEALTH_TIMEOUT_S
from selfopd.serving.server import ServerError
from selfopd.serving.server_control import ServerControl
from selfopd.serving.weight_digest import dtype_name

if TYPE_CHECKING:
    import torch

    from selfopd.serving.transfer_wire import Group
    from selfopd.serving.weight_digest import Entry


class PushMembership:
    """The servers of a `WeightTransfer` that answer, and the URLs that reach each: the transfer sets the
    attributes up and provides `_entries` and `_open_groups`."""

    controls: list[ServerControl]
    server_groups: list[list[ServerControl]]
    groups: list[Group]
    reach: dict[frozenset, list[ServerControl]]  # a server's processes -> every URL reaching it
    lost: list[list[ServerControl]]  # the URLs of each server left out, none of them answering
    expected_entries: dict[str, list[list[Entry]]]
    untrained: dict[str, int]
    _verified_version: int | None
    backend: str
    dtype: torch.dtype
    timeout_s: float
    host: str
    port: int

    def _reroute(self) -> bool:
        """Drive each server through a URL that reaches it: one whose URL no longer answers (or answers
        from another process: the server restarted) is switched to another URL of the same server (its
        workers, the collective's ranks, unchanged; the engine that dropped the URL said so already). A
        server no URL reaches is left out; one left out that answers again joins back; then the groups
        reopen (`_reopen`). Returns whether the servers changed."""
        changed = False
        for instances, urls in list(self.reach.items()):
            current = next(c for c in urls if c in self.controls)
            if processes(current) == instances:
                continue
            other = next((c for c in urls if c is not current and processes(c) == instances), None)
            if other is None:
                self._leave_out(instances, current)
                changed = True
                continue
            self.controls[self.controls.index(current)] = other
            self.server_groups = [[other if c is current else c for c in group] for group in self.server_groups]
            self.expected_entries[other.url] = self.expected_entries.pop(current.url)
            self.untrained[other.url] = self.untrained.pop(current.url)
        for urls in list(self.lost):
            found = self._answering(urls)
            if found is not None:
                self._take_back(urls, *found)
                changed = True
        if changed:
            self._reopen()
        return changed

    def _leave_out(self, instances: frozenset, current: ServerControl) -> None:
        """A server no URL reaches leaves the push (kept in `lost`, to join back when it answers)."""
        self.lost.append(self.reach.pop(instances))
        self.controls.remove(current)
        self.server_groups = [[c for c in group if c is not current] for group in self.server_groups]
        self.expected_entries.pop(current.url)
        self.untrained.pop(current.url)

    def _answering(self, urls: list[ServerControl]) -> tuple[ServerControl, frozenset] | None:
        """A URL of a server left out that answers again with selfopd's engine in the run's dtype, and the
        server's processes; None while none does."""
        for control in urls:
            try:
                states = control.rpc("selfopd_transfer_state", timeout=HEALTH_TIMEOUT_S)
            except ServerError:
                continue
            if states and all(s.get("selfopd") and s.get("dtype") == dtype_name(self.dtype) for s in states):
                return control, frozenset(state.get("instance") for state in states)
        return None

    def _take_back(self, urls: list[ServerControl], control: ServerControl, instances: frozenset) -> None:
        """A server left out that answers again rejoins (with NCCL in a group of its own: it shares a GPU
        with no one there)."""
        self.lost.remove(urls)
        self.reach[instances] = [control, *(c for c in urls if c is not control)]
        self.controls.append(control)
        if self.backend == "gloo" and self.server_groups:
            self.server_groups[0].append(control)  # one group on a CPU
        else:
            self.server_groups.append([control])
        self.expected_entries[control.url] = self._entries(control, "selfopd_weight_layout")
        self.untrained[control.url] = 0  # the same model as the others: not counted twice in the stats

    def _reopen(self) -> None:
        """The groups again, over the servers now in the push: each server leaves its old group first
        (a collective's ranks are fixed when it opens)."""
        if not self.controls:
            raise ServerError(f"{', '.join(c.url for urls in self.lost for c in urls)}: no server of this weight push "
                              "answers any more")
        self.server_groups = [group for group in self.server_groups if group]
        for group in self.groups:
            group.close()
        self.groups = []
        for control in self.controls:
            control.rpc("selfopd_release_transfer", timeout=self.timeout_s)
        self._open_groups(self.host, self.port)

    def holds(self, url: str, version: int) -> bool:
        """Whether `url` reaches one of this transfer's servers, the very process whose push of `version`
        was verified by digest (a server that restarted holds the weights once a push took it back)."""
        if self._verified_version != version:
            return False
        for instances, controls in self.reach.items():
            if any(control.url == url.rstrip("/") for control in controls):
                control = next(control for control in controls if control.url == url.rstrip("/"))
                return processes(control) == instances
        return False


def processes(control: ServerControl) -> frozenset | None:
    """The processes of the server `control` reaches (its workers' host:pid), or None when it does not answer."""
    try:
        states = control.rpc("selfopd_transfer_state", timeout=HEALTH_TIMEOUT_S)
    except ServerError:
        return None
    return frozenset(state.get("instance") for state in states)
