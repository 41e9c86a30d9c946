"""Programs that wait for each other, emulated one at a time, each in a thread of its own.

An emulator whose programs synchronise (the subcores of a SparseCore at a barrier, the devices
of a ``shard_map`` on semaphores) runs each program in a thread and lets exactly one run at a
time. A program that must wait calls :meth:`Turns.wait_until` with the condition it waits for;
the turn then passes, round robin, to the next program that can go on (one that has not
finished and is not waiting, or whose condition now holds). When no program can go on and some
have not finished, the programs would hang on the hardware: the emulator reports the deadlock,
naming what each waiting program waits for, instead of hanging itself. Running one program at a
time keeps the emulation deterministic (the same order on every run) and free of data races.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class Aborted(BaseException):
    """Unwinds a waiting program when another one has failed (never reaches the user)."""


Deadlock = Callable[[list[tuple[str, str]], list[str]], BaseException]
"""``deadlock(waiting, finished)`` -> the error to raise: ``waiting`` holds ``(program, what it
waits for)`` pairs, ``finished`` the names of the programs that have ended."""


class Turns:
    """Runs programs one at a time, each in its own thread, switching where one waits."""

    def __init__(self, names: Sequence[str], deadlock: Deadlock) -> None:
        self.names = list(names)
        self._deadlock = deadlock
        self._cv = threading.Condition()
        self._turn = -1
        self._done = [False] * len(self.names)
        self._waiting: dict[int, tuple[Callable[[], bool], str]] = {}
        self._error: BaseException | None = None
        self._me = threading.local()

    def run(self, programs: Sequence[Callable[[], None]]) -> None:
        """Runs ``programs`` (one per name) to their ends; re-raises the first error."""
        if len(programs) != len(self.names):
            raise ValueError(f"{len(programs)} programs for {len(self.names)} names")
        threads = [threading.Thread(target=self._main, args=(k, p), daemon=True,
                                    name=self.names[k]) for k, p in enumerate(programs)]
        for t in threads:
            t.start()
        with self._cv:
            self._turn = 0
            self._cv.notify_all()
        for t in threads:
            t.join()
        if self._error is not None:
            raise self._error

    def current(self) -> int:
        """The index of the program calling (from inside one of the programs)."""
        return int(self._me.index)

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Called by the running program: lets the others run until ``ready()`` holds."""
        if ready():
            return
        k = self.current()
        with self._cv:
            self._waiting[k] = (ready, what)
            try:
                self._hand_over(k)
                while self._turn != k and self._error is None:
                    self._cv.wait()
            finally:
                del self._waiting[k]
            if self._error is not None:
                raise Aborted

    def _main(self, k: int, program: Callable[[], None]) -> None:
        self._me.index = k
        with self._cv:
            while self._turn != k and self._error is None:
                self._cv.wait()
        try:
            if self._error is None:
                program()
        except Aborted:
            pass
        except BaseException as e:  # re-raised by run(), in the caller's thread
            with self._cv:
                if self._error is None:
                    self._error = e
        finally:
            with self._cv:
                self._done[k] = True
                self._hand_over(k)

    def _can_go_on(self, j: int) -> bool:
        if self._done[j]:
            return False
        waits = self._waiting.get(j)
        return waits is None or waits[0]()

    def _hand_over(self, k: int) -> None:
        """Gives the turn to the next program after ``k`` that can go on (under the lock)."""
        n = len(self.names)
        nxt = next((j % n for j in range(k + 1, k + 1 + n) if self._can_go_on(j % n)), None)
        if nxt is not None:
            self._turn = nxt
        elif not all(self._done) and self._error is None:
            waiting = [(self.names[j], what) for j, (_, what) in sorted(self._waiting.items())
                       if not self._done[j]]
            finished = [name for j, name in enumerate(self.names) if self._done[j]]
            self._error = self._deadlock(waiting, finished)
        self._cv.notify_all()


__all__ = ["Aborted", "Deadlock", "Turns"]
