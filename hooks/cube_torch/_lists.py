"""Publishing a stream as positions in a registered file list, for the publisher.

A dataset's paths are registered once per daemon (POST /v1/lists); each epoch's order then goes
as 4 bytes a file (`_Registry` maps dataset indices to list entries). `ListPublishing` is the
publisher's part that does it: `_publisher.Publisher` inherits it, and falls back to paths where
positions cannot be used (no daemon yet, a daemon without lists, paths held over an outage).
"""

from __future__ import annotations

import array
import operator
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from . import _client

if TYPE_CHECKING:
    from ._publisher import Stream

MAX_POST_BYTES = 4 << 20    # a POST's paths, well under the daemon's 16 MiB body limit
MAX_STREAM_RECREATES = 16   # after a 404 (the daemon expired the stream, or restarted)
# Positions, and paths registered, in one request: the daemon's control.max_json_elements by
# default.
MAX_POSITIONS_PER_POST = 1 << 17
# Dataset indices past this are published as paths: the registry keeps 4 bytes an index up to
# the largest one met (16 MiB here), and the daemon's default list limit (128 MiB a user)
# holds about 2.8 M ImageNet-length paths anyway.
MAX_REGISTERED_INDEX = 1 << 22
# CUBE_TORCH_POSITIONS=0: publish paths (JSON) as before file lists, e.g. to compare.
POSITIONS = os.environ.get("CUBE_TORCH_POSITIONS", "1") != "0"


class _Registry:
    """One dataset's file list on one daemon: dataset index -> its entries in the list.
    `first[i]` is 1 + the entry of index i's only file, 0 for an index not registered yet,
    and OTHER for one with none or several files (their entries in `other`). 4 bytes an
    index up to the largest met (at most MAX_REGISTERED_INDEX), where a dict of paths would
    hold some 150."""

    OTHER = 0xFFFFFFFF

    __slots__ = ("list_id", "size", "first", "other", "refused")

    def __init__(self) -> None:
        self.list_id: Optional[str] = None
        self.refused = False  # the daemon refused it (429): this dataset publishes paths
        self.size = 0  # entries in the list
        self.first = array.array("I")
        self.other: Dict[int, Tuple[int, int]] = {}  # index -> (first entry, count)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def add(self, run: List[Tuple[int, int]]) -> None:
        """Each (index, count) of `run` in turn: the index's `count` files are the next
        entries of the list."""
        if not run:
            return
        have = len(self.first)
        top = max(run)[0]
        if top >= have:  # grown by half at least: amortized O(1) an index
            grown = min(max(top + 1, have + have // 2 + 1024), MAX_REGISTERED_INDEX)
            self.first.frombytes(bytes(4 * (grown - have)))
        first, other, size, OTHER = self.first, self.other, self.size, self.OTHER
        for i, count in run:
            if count == 1 and size + 1 < OTHER:
                first[i] = size + 1
            else:
                first[i] = OTHER
                other[i] = (size, count)
            size += count
        self.size = size

    def extend(self, out: array.array, i: int) -> None:
        e = self.first[i]
        if e != self.OTHER:
            out.append(e - 1)
        else:
            start, count = self.other[i]
            out.extend(range(start, start + count))


class ListPublishing:
    """The publisher's methods that publish positions (mixed into `_publisher.Publisher`, whose
    state they use: its counters, its daemons' registries and its requests)."""


    def _registry(self, stream: Stream) -> Optional[_Registry]:
        """The file list of the stream's dataset on its daemon (made on first use), or None
        where positions cannot be used: no daemon yet, a daemon without lists, a mapper that
        cannot be weakly referenced, paths held while the daemon did not answer, or a stream
        the daemon made for paths."""
        daemon = stream.daemon
        if daemon is None or stream.held or not POSITIONS:
            return None
        if stream.stream_id is not None and stream.list_id is None:
            return None  # made for paths (after an outage): it keeps them until it ends
        if daemon.control_socket in self._no_lists:
            return None
        try:
            per_daemon = self._registries.get(stream.mapper)
            if per_daemon is None:
                per_daemon = self._registries[stream.mapper] = {}
        except TypeError:  # not weak-referenceable
            return None
        reg = per_daemon.get(daemon.control_socket)
        if reg is None:
            reg = per_daemon[daemon.control_socket] = _Registry()
        return None if reg.refused else reg

    def _discover_for(self, stream: Stream, batches: List[Tuple[Any, ...]]) -> bool:
        """Finds the stream's daemon from the first file its items name; False if none."""
        if stream.daemon is not None:
            return True
        for batch in batches:
            for index in batch:
                try:
                    paths = stream.mapper(index)
                except Exception:
                    continue
                if paths:
                    stream.daemon = self._discover(paths[0])
                    if stream.daemon is None:
                        stream.quiet = True
                        self._count("skipped", sum(len(b) for b in batches))
                    return stream.daemon is not None
        return False

    def _publish_positions(self, stream: Stream, batches: List[Tuple[Any, ...]],
                           before: Optional[List[Tuple[Any, ...]]] = None,
                           first: int = 0) -> bool:
        """Publishes `batches` as positions in the dataset's registered file list: each file's
        path is sent once per dataset (and daemon), each epoch's order as 4 bytes a file.
        False when the batches must go as paths instead (nothing was sent then). `before`:
        the items sent before them that the loop may not have read, sent again first when the
        daemon turns out to have restarted (its list is gone)."""
        if not self._discover_for(stream, batches):
            return stream.quiet  # quiet: counted as skipped already
        assert stream.daemon is not None
        reg = self._registry(stream)
        if reg is None:
            return False
        if time.monotonic() < self._down_until.get(stream.daemon.control_socket, 0.0):
            return False  # held as paths by _publish
        n_indices = sum(len(b) for b in batches)
        if time.monotonic() < stream.refused_until:
            self._count("dropped", n_indices)
            return True
        client = self._client_for(stream.daemon)
        recent = None if stream.recent is None else list(stream.recent)
        items = batches
        for attempt in (0, 1):
            if recent is not None and stream.recent is not None:
                stream.recent.clear()  # as before these batches: a failed try leaves none
                stream.recent.extend(recent)
            try:
                positions = self._positions(client, stream, reg, batches)
                if positions is None:
                    return False
                self._send_positions(client, stream, reg, positions)
                if stream.sent is not None:  # delivered: sent again if the daemon restarts
                    stream.sent.extend(enumerate(items, first))
                return True
            except _client.ControlError as e:
                if e.status in (404, 405) and e.code == "not_supported":
                    # A daemon from before file lists: paths, as before, from now on.
                    self._no_lists.add(stream.daemon.control_socket)
                    return False
                if e.status == 410 and attempt == 0:
                    # The list expired or the daemon restarted: register it again, and send
                    # the items the loop may not have read yet first (the window it lost).
                    reg.reset()
                    self._forget_stream(client, stream)
                    if before:
                        batches = list(before) + list(batches)
                        recent = [] if recent is not None else None
                        self._count("resent", sum(len(b) for b in before))
                    continue
                if recent is not None and stream.recent is not None:
                    stream.recent.clear()
                    stream.recent.extend(recent)
                if e.status == 0:
                    # No answer: _publish holds the batches' paths until it answers again.
                    self._count("errors")
                    self._silent(stream, e)
                    return False
                if e.status in (404, 410, 422, 429):
                    return False  # _publish recreates or counts them as it does
                self._count("errors")
                stream.quiet = True
                self._warn(f"{e}; the files of {stream.name} are no longer published "
                           "(training goes on, reading from the store)")
                return True
        return False

    def _positions(self, client: _client.ControlClient, stream: Stream, reg: "_Registry",
                   batches: List[Tuple[Any, ...]]) -> Optional[array.array]:
        """The positions of `batches`' files, registering the files of indices not yet
        registered; None if an index is not a small non-negative integer."""
        try:
            flat = [operator.index(i) for batch in batches for i in batch]
        except TypeError:
            return None
        if flat and (min(flat) < 0 or max(flat) >= MAX_REGISTERED_INDEX):
            return None
        first = reg.first
        have = len(first)
        new = [i for i in dict.fromkeys(flat) if i >= have or not first[i]]
        if new:
            self._register(client, stream, reg, new)
            first = reg.first
        recent = stream.recent
        entries = [first[i] for i in flat]
        if reg.OTHER not in entries:  # one file an index (most datasets): no loop in Python
            positions = array.array("I", [e - 1 for e in entries])
            if recent is not None:
                recent.extend(len(batch) for batch in batches)
            return positions
        positions = array.array("I")
        at = 0
        for batch in batches:
            before = len(positions)
            for _ in batch:
                reg.extend(positions, flat[at])
                at += 1
            if recent is not None:
                recent.append(len(positions) - before)
        return positions

    def _register(self, client: _client.ControlClient, stream: Stream, reg: "_Registry",
                  indices: List[int]) -> None:
        """Maps `indices` to the paths inside the daemon's mount and registers them, in
        requests of about MAX_POST_BYTES that never split one index's files."""
        assert stream.daemon is not None
        mount = stream.daemon.mount_point
        mapper, inside, fsencode = stream.mapper, self._filter.inside, os.fsencode
        singles = getattr(mapper, "singles", None)
        paths = singles(indices) if singles is not None else None
        if paths is not None:  # one str path an index (ImageFolder and lists of paths)
            self._register_singles(client, stream, reg, indices, [inside(p, mount) for p in paths])
            return
        payload = bytearray()
        run: List[Tuple[int, int]] = []  # (index, its files) in `payload`
        in_run = 0  # files in `payload`: at most the daemon's paths a request
        unmapped = skipped = 0
        for i in indices:
            try:
                raw = mapper(i)
            except Exception:
                unmapped += 1
                raw = ()
            if len(raw) == 1:  # most datasets: one file an index, no inner loop
                q = inside(raw[0], mount)
                if q is None:
                    skipped += 1
                    encoded: List[bytes] = []
                else:
                    encoded = [fsencode(q)]
            else:
                encoded = []
                for p in raw:
                    q = inside(p, mount)
                    if q is None:
                        skipped += 1
                    else:
                        encoded.append(fsencode(q))
            n = len(encoded)
            size = n + sum(map(len, encoded))
            if run and (len(payload) + size > MAX_POST_BYTES
                        or in_run + n > MAX_POSITIONS_PER_POST):
                self._send_run(client, stream, reg, payload, run)
                payload, run, in_run = bytearray(), [], 0
            for e in encoded:
                payload += e
                payload += b"\0"
            run.append((i, n))
            in_run += n
        if run:
            self._send_run(client, stream, reg, payload, run)
        if unmapped:
            self._count("unmapped", unmapped)
        if skipped:
            self._count("skipped", skipped)

    def _register_singles(self, client: _client.ControlClient, stream: Stream, reg: "_Registry",
                          indices: List[int], inside: List[Optional[str]]) -> None:
        """_register for indices of one path each, `inside` their paths in the mount (None:
        outside it, skipped): each request's paths are encoded at once, not one by one."""
        skipped = inside.count(None)
        start = 0
        while start < len(indices):
            end = min(len(indices), start + MAX_POSITIONS_PER_POST)
            while True:
                kept = [q for q in inside[start:end] if q is not None]
                payload = os.fsencode("\0".join(kept) + "\0") if kept else b""
                if len(payload) <= MAX_POST_BYTES or end - start == 1:
                    break
                end = start + (end - start) // 2  # long paths: fewer a request
            run = [(i, 0 if q is None else 1)
                   for i, q in zip(indices[start:end], inside[start:end])]
            self._send_run(client, stream, reg, payload, run, len(kept))
            start = end
        if skipped:
            self._count("skipped", skipped)

    def _send_run(self, client: _client.ControlClient, stream: Stream, reg: "_Registry",
                  payload: Union[bytes, bytearray], run: List[Tuple[int, int]],
                  count: Optional[int] = None) -> None:
        """Appends `payload` (NUL-terminated paths: the files of the indices of `run`) to the
        registry's list, then numbers those indices' files."""
        if count is None:
            count = sum(n for _, n in run)
        if count:
            try:
                reply = client.register_list_raw(bytes(payload), count, reg.list_id)
            except _client.ControlError as e:
                if e.status == 429:  # over the daemon's list limits: paths instead
                    reg.reset()  # frees its index array
                    reg.refused = True
                    self._warn(f"{e}; the files of {stream.name} are published as "
                               "paths (training goes on)")
                raise
            if reply["first"] != reg.size:
                raise _client.ControlError(
                    f"file list {reply['id']}: numbered from {reply['first']}, "
                    f"expected {reg.size}", 410)
            reg.list_id = reply["id"]
            self._count("registered", count)
            if reply["rejected"]:
                self._count("rejected", reply["rejected"])
        reg.add(run)

    def _send_positions(self, client: _client.ControlClient, stream: Stream, reg: "_Registry",
                        positions: array.array) -> None:
        if not len(positions):
            return
        if stream.stream_id is not None and stream.list_id != reg.list_id:
            self._forget_stream(client, stream)  # made for a list that is gone
        if stream.stream_id is None:
            stream.list_id = reg.list_id
            self._create(client, stream, paths_only_if_gone=False)
        assert stream.stream_id is not None
        if sys.byteorder != "little":
            positions = array.array("I", positions)
            positions.byteswap()
        unread = None if stream.recent is None else sum(stream.recent)
        later = len(positions)
        for start in range(0, len(positions), MAX_POSITIONS_PER_POST):
            chunk = positions[start:start + MAX_POSITIONS_PER_POST]
            later -= len(chunk)
            try:
                reply = client.publish_positions(
                    stream.stream_id, chunk.tobytes(),
                    None if unread is None else max(0, unread - later))
            except _client.ControlError as e:
                if e.status == 429:
                    self._refused(stream, e, len(chunk))
                    return
                if e.status == 404 and stream.recreated < MAX_STREAM_RECREATES:
                    stream.recreated += 1  # the daemon expired the stream (idle)
                    self._create(client, stream, paths_only_if_gone=False)
                    reply = client.publish_positions(
                        stream.stream_id, chunk.tobytes(),
                        None if unread is None else max(0, unread - later))
                else:
                    raise
            self._count("published", reply["accepted"])
            self._answered(stream.daemon.control_socket)
            self._count("rejected", reply["rejected"])

    def _forget_stream(self, client: _client.ControlClient, stream: Stream) -> None:
        """Deletes the daemon's stream (best effort): the next publish makes a new one."""
        if stream.stream_id is not None:
            try:
                client.delete_stream(stream.stream_id)
            except _client.ControlError:
                pass
        self._open.pop(id(stream), None)
        stream.stream_id = None
        stream.list_id = None
