"""Publishing streams of file paths to the daemon, off the training thread.

A `Stream` is one pass of one DataLoader iterator over its sampler. The training thread only
hands it index batches (`Stream.submit`, a queue put); one daemon thread per process (the
publisher) maps indices to paths, finds the daemon whose mount holds them, creates the stream on
the daemon at its first non-empty publish, sends the paths (several queued batches coalesce
into one POST) and deletes the stream when it is closed.

Never breaking training: the queue is bounded (a batch that does not fit is dropped and
counted), every request has a bounded timeout, and a stream whose daemon is missing, dead, slow
or answers nonsense goes quiet, with one warning per process. Nothing here raises into the
caller.

Fork safety: the publisher belongs to the process that created it. A forked child (DataLoader
workers included) starts with no publisher, ignores streams inherited from its parent, and
gets a fresh publisher only if it iterates a DataLoader of its own.
"""

from __future__ import annotations

import atexit
import collections
import errno
import itertools
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple

from . import _batch, _client, _common, _report
# A POST's size and a stream's re-creations are bounded alike for paths and positions (_lists).
from ._lists import MAX_POST_BYTES, MAX_STREAM_RECREATES, ListPublishing, _Registry
from ._mounts import _daemon_silent_message, _elsewhere_message, _MountFilter, probe_mount
from ._paths import PathMapper

MAX_QUEUED_BATCHES = 1024   # batches waiting for the publisher thread
MAX_ITEMS_PER_CYCLE = 4096  # queue items drained before the thread sends anything
EXIT_WAIT_S = 0.5           # how long interpreter exit waits for final DELETEs
STATS_FLUSH_S = 1.0         # stats() waits this long at most for queued batches to be sent
DOWN_COOLDOWN_S = 2.0       # a daemon that timed out is not asked again for this long
GONE_COOLDOWN_S = 0.2       # nor one with no socket or refusing connections (restarting)
# A daemon with no socket or refusing connections for less than this is being upgraded or
# restarted by its supervisor: routine, so nothing is printed (what it missed is held and sent).
SILENT_GRACE_S = 10.0
FULL_COOLDOWN_S = 1.0       # after a 429 (queued-path limits), a stream's batches are dropped
MAX_HELD_PATHS = 1 << 16    # a stream's paths kept while its daemon does not answer

_BATCH, _CLOSE, _FLUSH, _STOP = range(4)

_names = itertools.count(1)


class Stream:
    """One DataLoader pass's files. `submit` and `close_stream` are for the training side;
    the attributes after `closed` belong to the publisher thread."""

    __slots__ = ("name", "mapper", "auto_collation", "owner_pid", "publisher", "closed",
                 "daemon", "stream_id", "quiet", "recreated", "recent", "refused_until",
                 "held", "held_paths", "list_id", "sent", "resend", "served", "__weakref__")

    def __init__(self, dataset_name: str, mapper: PathMapper,
                 auto_collation: Optional[bool], unread_items: Optional[int] = None) -> None:
        self.name = dataset_name  # numbered at the first submit: "<DatasetClass>:<n>"
        self.mapper = mapper
        self.auto_collation = auto_collation  # None: a list/tuple item is a batch
        # The paths of each of the latest `unread_items` sampler items: the loop may not have
        # read those yet, but it has read every earlier one (None: unknown, not said).
        self.recent: Optional[Deque[int]] = (
            None if unread_items is None else collections.deque(maxlen=max(1, unread_items)))
        self.refused_until = 0.0  # after a 429: the batches until then are dropped
        self.owner_pid = os.getpid()
        self.publisher: Optional[Publisher] = None
        self.closed = False
        self.daemon: Optional[_client.Daemon] = None
        self.stream_id: Optional[str] = None
        self.quiet = False
        self.recreated = 0
        # While the daemon does not answer (restarting, upgrading, timed out): the paths not
        # sent, with the count of indices they came from, oldest first. Sent before the next
        # batch once it answers again, so that a restart loses none of the window.
        self.held: Deque[Tuple[List[str], int]] = collections.deque()
        self.held_paths = 0  # the paths in `held`
        self.list_id: Optional[str] = None  # the file list the daemon's stream was made with
        # The latest `unread_items` sampler items handed to the daemon: what the loop may not
        # have read yet. A daemon that restarted (or was upgraded) lost them with its stream;
        # they are sent to the next one first (`resend`), so prefetching goes on where it was.
        # Each with its number among the items served (`served`): only those among the latest
        # `unread_items` served are still unread (an outage that outlasts the window leaves
        # nothing to send again).
        self.sent: Optional[Deque[Tuple[int, Tuple[Any, ...]]]] = (
            None if unread_items is None else collections.deque(maxlen=max(1, unread_items)))
        self.resend: List[Tuple[Any, ...]] = []
        self.served = 0  # sampler items the publisher has taken, in all

    def submit(self, item: Any) -> None:
        """Queues the files of one sampler item (a batch of indices, or one index)."""
        if self.closed or self.owner_pid != os.getpid():
            return
        batch = self.auto_collation
        if batch is None:
            batch = isinstance(item, (list, tuple))
        indices = tuple(item) if batch else (item,)
        publisher = self.publisher
        if publisher is None:
            self.name = f"{self.name}:{next(_names)}"
            publisher = self.publisher = get_publisher()
        publisher.submit(self, indices)


def close_stream(stream: Stream, finished: bool = False) -> None:
    """Ends `stream`: no more submits; the daemon's stream is deleted after what was queued.
    `finished`: the loop read every item (the iterator ran out), which the daemon is told
    first: the positions no read reached it for were read from the page cache. Safe from any
    thread, a weakref callback or a forked child (where it does nothing)."""
    if stream.closed:
        return
    stream.closed = True
    publisher = stream.publisher
    if publisher is not None and stream.owner_pid == os.getpid():
        publisher.close(stream, finished)


def zero_counters() -> Dict[str, int]:
    """This process's counters: paths the daemon accepted (published) and refused (rejected);
    indices dropped (queue full, their stream had gone quiet, or held while its daemon did not
    answer and then over the bound or closed before it answered); failed requests (errors);
    paths not sent because they are outside the daemon's mount or no daemon serves them
    (skipped); indices the dataset could not name (unmapped); streams created; indices sent
    again to a daemon that restarted, the window it lost (resent)."""
    return dict.fromkeys(
        ("published", "rejected", "dropped", "errors", "skipped", "unmapped", "streams",
         "registered", "resent"), 0)


def _chunks(paths: List[str], max_bytes: int) -> Iterable[List[str]]:
    """Splits `paths` into runs whose JSON encoding stays about under `max_bytes`."""
    start, size = 0, 0
    for i, p in enumerate(paths):
        n = (len(p) if p.isascii() else 12 * len(p)) + 4  # JSON escapes non-ASCII (\uXXXX, pairs)
        if size + n > max_bytes and i > start:
            yield paths[start:i]
            start, size = i, 0
        size += n
    if start < len(paths):
        yield paths[start:]


class Publisher(ListPublishing):
    def __init__(self) -> None:
        self._pid = os.getpid()
        self._queue: "queue.SimpleQueue[Tuple[int, Any, Any]]" = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _queued, _counters, _thread
        self._queued = 0
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._counters = zero_counters()
        self._cpu_s = 0.0  # the publisher thread's CPU time, as of its latest cycle
        # Publisher thread only:
        self._clients: Dict[str, _client.ControlClient] = {}
        self._down_until: Dict[str, float] = {}  # control socket -> monotonic time
        self._silent_since: Dict[str, float] = {}  # control socket -> first failure unanswered
        self._grace: Set[str] = set()  # sockets silent while their mount answers (SILENT_GRACE_S)
        self._open: Dict[int, Stream] = {}  # streams created on a daemon and not yet deleted
        self._filter = _MountFilter()
        self._reporter = _report.Reporter()
        self._next_report = 0.0
        self.last_daemon: Optional[_client.Daemon] = None  # the daemon of the latest stream
        # A dataset's (mapper's) file list on each daemon, for as long as the mapper lives.
        self._registries: "weakref.WeakKeyDictionary[Any, Dict[str, _Registry]]" = (
            weakref.WeakKeyDictionary())
        self._no_lists: Set[str] = set()  # control sockets of daemons without file lists

    # --- the training side ---

    def submit(self, stream: Stream, indices: Tuple[Any, ...]) -> None:
        with self._lock:
            if self._stopped or self._queued >= MAX_QUEUED_BATCHES:
                self._counters["dropped"] += len(indices)
                return
            self._queued += 1
            if self._thread is None:
                self._start_locked()
        self._queue.put((_BATCH, stream, indices))

    def close(self, stream: Stream, finished: bool = False) -> None:
        # SimpleQueue.put is reentrant: safe from weakref callbacks and __del__.
        self._queue.put((_CLOSE, stream, finished))

    def flush(self, timeout: float) -> bool:
        """Waits until everything queued before the call has been handled."""
        with self._lock:
            if self._thread is None:
                return True
        done = threading.Event()
        self._queue.put((_FLUSH, None, done))
        return done.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Deletes the open streams (best effort) and ends the thread, waiting up to `timeout`."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is None or self._pid != os.getpid():
            return
        self._queue.put((_STOP, None, None))
        thread.join(timeout)

    def counters(self) -> Dict[str, Any]:
        with self._lock:
            out: Dict[str, Any] = dict(self._counters)
            out["cpu_s"] = self._cpu_s
            return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _start_locked(self) -> None:
        thread = threading.Thread(target=self._run, name="cube_torch-publisher", daemon=True)
        thread.start()
        self._thread = thread

    # --- the publisher thread ---

    def _run(self) -> None:
        stop = False
        while not stop:
            items = self._take()
            try:
                stop = self._handle(items)
            except Exception as e:  # a bug here must not kill the thread silently
                self._warn(f"internal error, publishing stopped for some batches: {e!r}")
            finally:
                with self._lock:  # this thread's CPU so far (counters(): "cpu_s")
                    self._cpu_s = time.thread_time()
                for kind, _, payload in items:
                    if kind == _FLUSH:
                        payload.set()
            self._maybe_report()
        for client in self._clients.values():
            client.close()

    def _take(self) -> List[Tuple[int, Any, Any]]:
        timeout = 5.0
        if _common.verbose():
            timeout = max(0.05, min(timeout, self._next_report - time.monotonic()))
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(items) < MAX_ITEMS_PER_CYCLE:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        batches = sum(1 for kind, _, _ in items if kind == _BATCH)
        with self._lock:
            self._queued -= batches
        return items

    def _handle(self, items: Iterable[Tuple[int, Any, Any]]) -> bool:
        """Serves queued items, each stream's in order; True on a stop request."""
        groups: Dict[int, Tuple[Stream, List[Tuple[Any, ...]], List[bool]]] = {}
        stop = False
        for kind, stream, payload in items:
            if kind == _STOP:
                stop = True
            elif kind in (_BATCH, _CLOSE):
                group = groups.setdefault(id(stream), (stream, [], [False, False]))
                if kind == _BATCH:
                    group[1].append(payload)
                else:
                    group[2][0] = True
                    group[2][1] = bool(payload)
        for stream, batches, close in groups.values():
            self._serve(stream, batches, close[0], close[1])
        if stop:
            for stream in list(self._open.values()):
                self._delete(stream)
            self._delete_lists()
        return stop

    def _delete_lists(self) -> None:
        """Deletes this process's file lists on their daemons (best effort: they also expire)."""
        for per_daemon in list(self._registries.values()):
            for sock, reg in per_daemon.items():
                if reg.list_id is None:
                    continue
                client = self._clients.get(sock)
                if client is not None:
                    try:
                        client.delete_list(reg.list_id)
                    except _client.ControlError:
                        pass
                reg.reset()

    def _serve(self, stream: Stream, batches: List[Tuple[Any, ...]], close: bool,
               finished: bool = False) -> None:
        if stream.quiet:
            self._count("dropped", sum(len(b) for b in batches))
        elif batches:
            first = stream.served
            stream.served += len(batches)
            before: List[Tuple[Any, ...]] = []
            if stream.sent is not None and stream.sent.maxlen:
                oldest_unread = stream.served - stream.sent.maxlen
                before = [item for k, item in stream.sent if k >= oldest_unread]
            if not self._publish_positions(stream, batches, before, first):
                self._publish(stream, self._map(stream, batches), sum(len(b) for b in batches),
                              before, batches, first)
        if close and finished:
            self._finish(stream)
        if close:
            self._delete(stream)

    def _finish(self, stream: Stream) -> None:
        """Tells the daemon the loop read every position of `stream` (unread 0)."""
        if stream.quiet or stream.stream_id is None or stream.daemon is None or stream.held:
            return
        try:
            client = self._client_for(stream.daemon)
            if stream.list_id is not None:
                client.publish_positions(stream.stream_id, b"", 0)
            else:
                client.publish(stream.stream_id, [], 0)
        except _client.ControlError:
            pass  # the delete that follows says what it must

    def _map(self, stream: Stream, batches: List[Tuple[Any, ...]]) -> List[str]:
        paths: List[str] = []
        unmapped = 0
        recent = stream.recent
        for batch in batches:
            before = len(paths)
            for index in batch:
                try:
                    paths.extend(stream.mapper(index))
                except Exception:
                    unmapped += 1
            if recent is not None:
                recent.append(len(paths) - before)
        if unmapped:
            self._count("unmapped", unmapped)
        return paths

    def _publish(self, stream: Stream, raw: List[str], n_indices: int,
                 before: Optional[List[Tuple[Any, ...]]] = None,
                 items: Optional[List[Tuple[Any, ...]]] = None, first: int = 0) -> None:
        """Publishes `raw` (the paths of sampler items `items`, `n_indices` indices) as
        paths; `before`: the items delivered before them, sent again first if the daemon
        turns out to have lost the stream (a restart)."""
        if not raw:
            return
        if stream.daemon is None:
            stream.daemon = self._discover(raw[0])
            if stream.daemon is None:
                stream.quiet = True
                self._count("skipped", len(raw))
                return
        mount = stream.daemon.mount_point
        paths = [q for q in (self._filter.inside(p, mount) for p in raw) if q is not None]
        if len(paths) < len(raw):
            self._count("skipped", len(raw) - len(paths))
        if time.monotonic() < self._down_until.get(stream.daemon.control_socket, 0.0):
            # It just failed us: do not wait on it again for a while. A daemon being upgraded
            # or restarted by its supervisor answers again within a second or two; the stream
            # is then created again (a 404 below), and what was held meanwhile is sent first.
            self._hold(stream, paths, n_indices)
            return
        if time.monotonic() < stream.refused_until:
            self._count("dropped", n_indices)
            return
        if stream.held:
            held = [p for chunk, _ in stream.held for p in chunk]
            n_indices += sum(n for _, n in stream.held)
            stream.held.clear()
            stream.held_paths = 0
            paths = held + paths
        client = self._client_for(stream.daemon)
        # At most `unread` of the stream's latest positions are still to be read: the paths of
        # the items in `recent`. Sent with each POST (less the paths of the POSTs after it),
        # it lets the daemon move the stream's cursor when the kernel serves reads from its
        # page cache and no read reaches the daemon: the stream then costs the daemon
        # O(lookahead) however long the epoch.
        unread = None if stream.recent is None else sum(stream.recent)
        sent = 0
        stream.resend = list(before or [])  # sent first if the daemon lost the stream (_post)
        try:
            if paths and stream.stream_id is None:
                self._create(client, stream)
            chunks = list(_chunks(paths, MAX_POST_BYTES))
            later = len(paths)
            for chunk in chunks:
                later -= len(chunk)
                if not self._post(client, stream, chunk,
                                  None if unread is None else max(0, unread - later)):
                    break
                sent += len(chunk)
            if sent == len(paths) and items and stream.sent is not None:
                stream.sent.extend(enumerate(items, first))  # delivered (see Stream.sent)
        except _client.ControlError as e:
            self._count("errors")
            if e.status == 0:  # no answer at all: timeout, refused, no socket
                # What was not sent is kept for when it answers, the POST that failed too:
                # had the daemon taken it, its paths are queued twice, and the second finds
                # the file in the window or the caches.
                unsent = n_indices - n_indices * sent // max(1, len(paths))
                self._hold(stream, paths[sent:], unsent)
                self._silent(stream, e)
                return
            stream.quiet = True
            self._warn(f"{e}; the files of {stream.name} are no longer published "
                       "(training goes on, reading from the store)")
        finally:
            stream.resend = []

    def _refused(self, stream: Stream, e: _client.ControlError, n: int) -> None:
        """A publish of `n` files went over a queued-path limit (429: other loaders of this user,
        or other users, hold the room): these files are read from the store as they come, and
        the stream's batches are dropped for FULL_COOLDOWN_S, as the readers free room."""
        self._count("rejected", n)
        stream.refused_until = time.monotonic() + FULL_COOLDOWN_S
        self._warn(f"{e}; some files of {stream.name} are not prefetched "
                   "(training goes on, reading them from the store)")

    def _answered(self, socket_path: str) -> None:
        """The daemon at `socket_path` answered: a silence before it is over."""
        if self._silent_since:
            self._silent_since.pop(socket_path, None)
            self._grace.discard(socket_path)

    def _silent(self, stream: Stream, e: _client.ControlError) -> None:
        """The stream's daemon did not answer (`e`): it is left alone for a while."""
        assert stream.daemon is not None
        # A daemon being upgraded or restarted has no socket, or refuses, for well under a
        # second: ask again soon. One that timed out may be hung: not as soon.
        gone = e.os_errno in (errno.ENOENT, errno.ECONNREFUSED)
        now = time.monotonic()
        socket_path = stream.daemon.control_socket
        self._down_until[socket_path] = now + (GONE_COOLDOWN_S if gone else DOWN_COOLDOWN_S)
        since = self._silent_since.setdefault(socket_path, now)
        if _common.has_warned("daemon"):
            return
        probed = None
        if gone and now - since < SILENT_GRACE_S:
            # An upgrade or a restart while the supervisor keeps the mount: routine, said only
            # if it lasts. The mount is probed once for it.
            if socket_path in self._grace:
                return
            probed = probe_mount(stream.daemon.mount_point)
            if probed[0] == "answers":
                self._grace.add(socket_path)
                return
        if probed is None:
            probed = probe_mount(stream.daemon.mount_point)
        self._warn(f"{e}; " + _daemon_silent_message(stream.daemon.mount_point, stream.name,
                                                      probed))

    def _create(self, client: _client.ControlClient, stream: Stream,
                paths_only_if_gone: bool = True) -> None:
        """Creates the daemon's stream, with the stream's file list if it has one. If that list
        is gone (410): a stream for paths, or the 410 raised (`paths_only_if_gone` false)."""
        # A daemon from before stream modes ignores the mode: a stream as in the prefetch mode.
        mode = "batch" if _batch.installed() else None
        try:
            stream.stream_id = client.create_stream(stream.name, stream.owner_pid,
                                                    stream.list_id, mode)
        except _client.ControlError as e:
            if e.status != 410 or stream.list_id is None or not paths_only_if_gone:
                raise
            stream.list_id = None  # its list is gone (the daemon restarted): paths only
            stream.stream_id = client.create_stream(stream.name, stream.owner_pid, None, mode)
        self._open[id(stream)] = stream
        self.last_daemon = stream.daemon
        self._count("streams")

    def _resend_paths(self, client: _client.ControlClient, stream: Stream, then: int,
                      unread: Optional[int]) -> None:
        """Sends the paths of `stream.resend` (the items the loop may not have read, which a
        restarted daemon lost) to its new stream, before a POST of `then` paths."""
        items, stream.resend = stream.resend, []
        paths: List[str] = []
        for batch in items:
            for index in batch:
                try:
                    paths.extend(stream.mapper(index))
                except Exception:
                    pass
        assert stream.daemon is not None
        mount = stream.daemon.mount_point
        paths = [q for q in (self._filter.inside(p, mount) for p in paths) if q is not None]
        for chunk in _chunks(paths, MAX_POST_BYTES):
            reply = client.publish(stream.stream_id, chunk,
                                   None if unread is None else max(0, unread - then))
            self._count("published", reply["accepted"])
        self._count("resent", sum(len(b) for b in items))

    def _post(self, client: _client.ControlClient, stream: Stream, paths: List[str],
              unread: Optional[int]) -> bool:
        """Sends one POST; False if the daemon refused it for its queued-path limits."""
        assert stream.stream_id is not None
        try:
            reply = client.publish(stream.stream_id, paths, unread)
        except _client.ControlError as e:
            if e.status == 422:  # the daemon disagrees that these are in its mount
                self._count("errors")
                self._count("rejected", len(paths))
                return True
            if e.status == 429:
                self._refused(stream, e, len(paths))
                return False
            if e.status != 404 or stream.recreated >= MAX_STREAM_RECREATES:
                raise
            stream.recreated += 1  # the daemon expired the stream (idle) or restarted
            self._create(client, stream)
            self._resend_paths(client, stream, len(paths), unread)
            reply = client.publish(stream.stream_id, paths, unread)
        self._count("published", reply["accepted"])
        self._answered(stream.daemon.control_socket)
        self._count("rejected", reply["rejected"])
        return True

    def _hold(self, stream: Stream, paths: List[str], n_indices: int) -> None:
        """Keeps `paths` (from `n_indices` indices) for the stream's next publish, dropping the
        oldest held beyond MAX_HELD_PATHS: those are the first to have been read meanwhile."""
        if not paths:
            return
        held = stream.held
        held.append((paths, n_indices))
        stream.held_paths += len(paths)
        while stream.held_paths > MAX_HELD_PATHS and held:
            chunk, n = held.popleft()
            stream.held_paths -= len(chunk)
            self._count("dropped", n)

    def _delete(self, stream: Stream) -> None:
        if stream.held:  # its daemon never answered again while the stream lasted
            self._count("dropped", sum(n for _, n in stream.held))
            stream.held.clear()
            stream.held_paths = 0
        if self._open.pop(id(stream), None) is None or stream.stream_id is None:
            return
        assert stream.daemon is not None
        try:
            self._client_for(stream.daemon).delete_stream(stream.stream_id)
        except _client.ControlError as e:
            if e.status != 404:
                self._count("errors")

    def _discover(self, sample_path: str) -> Optional[_client.Daemon]:
        daemons = _client.live_daemons()
        daemon = _client.daemon_for(sample_path, daemons)
        if daemon is None:
            where = _common.config_dir()
            vol = _common.vol_name()
            if not daemons and _client.last_untrusted():
                pass  # the untrusted control file (or socket) was warned about already
            elif not daemons:
                self._warn(f"no running cubetorchfs daemon announced in {where}"
                           + (f" for VOL_NAME={vol}" if vol else "") + "; not publishing")
            else:
                self._warn(_elsewhere_message(sample_path, daemons, where, vol))
        return daemon

    def _client_for(self, daemon: _client.Daemon) -> _client.ControlClient:
        client = self._clients.get(daemon.control_socket)
        if client is None:
            client = self._clients[daemon.control_socket] = _client.ControlClient(
                daemon.control_socket)
        return client

    def _warn(self, message: str) -> None:
        if not self._stopped:
            _common.warn_once("daemon", message)

    def _maybe_report(self) -> None:
        if not _common.verbose():
            return
        now = time.monotonic()
        if now < self._next_report:
            return
        self._next_report = now + _common.report_s()
        daemon = self.last_daemon
        if daemon is None or self._stopped:
            return
        try:
            counts = _report.global_counts(self._client_for(daemon).stats())
        except _client.ControlError:
            return
        if counts is not None:
            try:
                print(self._reporter.line(counts), file=sys.stdout, flush=True)
            except Exception:
                pass


# --- the process's publisher ---

_publisher: Optional[Publisher] = None
_publisher_lock = threading.Lock()
_hooks_registered = False


def _after_fork_in_child() -> None:
    global _publisher, _publisher_lock
    _publisher = None
    _publisher_lock = threading.Lock()
    _common.reset_warnings()


def _at_exit() -> None:
    publisher = _publisher
    if publisher is not None:
        publisher.stop(EXIT_WAIT_S)


def get_publisher() -> Publisher:
    global _publisher, _hooks_registered
    publisher = _publisher
    if publisher is not None:
        return publisher
    with _publisher_lock:
        if _publisher is None:
            if not _hooks_registered:
                os.register_at_fork(after_in_child=_after_fork_in_child)
                atexit.register(_at_exit)
                _hooks_registered = True
            _publisher = Publisher()
        return _publisher


def current_publisher() -> Optional[Publisher]:
    return _publisher


def reset(timeout: float = 3.0) -> None:
    """Stops this process's publisher and forgets all state (for tests)."""
    global _publisher
    with _publisher_lock:
        publisher, _publisher = _publisher, None
    if publisher is not None:
        publisher.stop(timeout)
    _common.reset_warnings()


def stats() -> Dict[str, Any]:
    """The daemon's /v1/stats (empty if none is reachable), plus this process's counters under
    "client". Waits (up to STATS_FLUSH_S) for the batches already queued to be sent first. The
    daemon asked is the one of the latest stream; before any, the one VOL_NAME names, or the
    only live one."""
    publisher = _publisher
    if publisher is not None and publisher._pid == os.getpid():
        publisher.flush(STATS_FLUSH_S)  # counters then cover every batch handed over so far
    counters: Dict[str, Any] = (publisher.counters() if publisher is not None
                                else dict(zero_counters(), cpu_s=0.0))
    out: Dict[str, Any] = {}
    try:
        daemon = publisher.last_daemon if publisher is not None else None
        if daemon is None:
            daemons = _client.live_daemons()
            daemon = daemons[0] if len(daemons) == 1 else None
        if daemon is not None:
            client = _client.ControlClient(daemon.control_socket)
            try:
                out = dict(client.stats())
            finally:
                client.close()
    except Exception:
        out = {}
    out["client"] = counters
    return out
