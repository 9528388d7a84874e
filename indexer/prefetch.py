"""Producing items ahead of their consumer, in a thread or in a child process.

The local engine reads and checks chunks while it encodes the previous ones. Checking JSON
Lines is Python code that holds the GIL, so a reader thread and the encoding thread take turns
on one core more than they share two (measured: the main process's CPU time per record fell by
a third with the child, and not with a thread); a child process has a GIL of its own. The child
is forked (it inherits the model and everything else; only the items it sends back are
pickled), and only from a process that runs no other Python thread: a fork copies one thread,
and a lock that another thread held stays locked in the child. Native threads that hold no
Python lock are fine: OpenMP's idle pool (torch's), which the child never uses, since checking
records runs no parallel torch operation. Otherwise, and where fork does not exist, a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def ahead(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    """The items of make()'s iterator, produced up to `depth` ahead; an error there is raised
    here, at the item where it happened; closing this generator stops the producer."""
    if "fork" in multiprocessing.get_all_start_methods() and forkable():
        return in_child(make, depth)
    return in_thread(make, depth)


def forkable() -> bool:
    """No Python thread but this one (a driver of Ray, for one, runs several)."""
    return threading.active_count() == 1


class _Done:
    pass


def in_thread(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    items: queue.Queue[T | BaseException | _Done] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: T | BaseException | _Done) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in make():
                if not put(item):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            put(exc)
            return
        put(_Done())

    thread = threading.Thread(target=produce, name="hclip-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if isinstance(item, _Done):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def in_child(make: Callable[[], Iterator[T]], depth: int) -> Generator[T, None, None]:
    """A forked child produces up to `depth` items ahead, each pickled into a slot of shared
    memory (anonymous, mapped before the fork) with a few bytes through a pipe to say which;
    the consumer hands the slot back once it has unpickled the item. An item bigger than a
    slot crosses the pipe itself.

    Why slots: through the pipe alone, the child could be one item ahead, and a 2 MB chunk
    crossed a 64 kB pipe in a few dozen write-wake-read turns between the two processes: on a
    1M-record build the encoder spent 1.5-2.5 s waiting on the pipe (measured, 2-vCPU Xeon)."""
    depth = min(max(1, depth), 255)  # a slot's number crosses as one byte
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)  # the child's headers (and any oversized item)
    returned, give_back = ctx.Pipe(duplex=False)  # slots the consumer is done with
    slots = [mmap.mmap(-1, SLOT_BYTES) for _ in range(depth)]
    child = ctx.Process(
        target=_produce_into,
        args=(make, send, returned, slots, os.getpid()),
        name="hclip-reader",
        daemon=True,
    )
    child.start()
    send.close()  # the child's ends
    returned.close()
    try:
        while True:
            if not receive.poll(POLL_S):
                if not child.is_alive() and not receive.poll(0):
                    raise RuntimeError(f"the reader process stopped (exit code {child.exitcode})")
                continue
            try:  # pickles from this process's own forked child, over a private pipe and map
                kind, value = pickle.loads(receive.recv_bytes())
                if kind == "slot":
                    index, size = value
                    with memoryview(slots[index]) as view:
                        item = pickle.loads(view[:size])  # copies out: the slot is free again
                    with contextlib.suppress(BrokenPipeError):  # a child that is done
                        give_back.send_bytes(bytes([index]))
                elif kind == "pipe":
                    item = pickle.loads(receive.recv_bytes())
            except EOFError:
                raise RuntimeError(
                    f"the reader process stopped (exit code {child.exitcode})"
                ) from None
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield item
    finally:
        if child.is_alive():
            child.kill()  # the consumer stopped early: nothing more is wanted
        child.join(timeout=5)
        receive.close()
        give_back.close()
        for slot in slots:
            slot.close()


SLOT_BYTES = 64 << 20  # address space only: a slot's pages exist once an item is written there


def _produce_into(
    make: Callable[[], Iterator[Any]],
    send: Any,
    returned: Any,
    slots: list[mmap.mmap],
    parent: int,
) -> None:
    _die_with(parent)
    _close_inherited(keep={0, 1, 2, send.fileno(), returned.fileno()})
    free = list(range(len(slots)))
    # Items cross as plain pickles: multiprocessing's own pickler would pass a torch tensor as
    # a handle to shared memory that this process must outlive, and it does not.
    try:
        for item in make():
            data = pickle.dumps(item, pickle.HIGHEST_PROTOCOL)
            if len(data) > SLOT_BYTES:
                send.send_bytes(pickle.dumps(("pipe", None)))
                send.send_bytes(data)
                continue
            if not free:  # wait for the consumer to finish with one
                free.append(returned.recv_bytes()[0])
            index = free.pop()
            slots[index][: len(data)] = data
            send.send_bytes(pickle.dumps(("slot", (index, len(data)))))
        send.send_bytes(pickle.dumps(("done", None)))
    except BaseException as exc:  # handed to the consumer, which raises it
        send.send_bytes(pickle.dumps(("error", _picklable(exc))))
    send.close()


def _close_inherited(keep: set[int]) -> None:
    """The parent's open files are not the child's: above all the index root's lock, which
    would stay held while the child lives, and the version's files, which it must never write."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _die_with(parent: int) -> None:
    """A SIGKILLed consumer takes its reader with it (Linux), so none outlives a killed job."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above ran
        os._exit(1)


def _picklable(exc: BaseException) -> BaseException:
    """The error itself when it survives the trip back; its type and message otherwise."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
