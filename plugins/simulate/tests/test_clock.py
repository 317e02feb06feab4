"""The virtual clock: work a thread does in answer to an event happens at the event's time."""

import queue
import threading

import pytest
from skip_plugin_simulate.clock import Clock, Deadlock


def test_a_reaction_on_another_thread_happens_at_the_virtual_time_of_what_it_answers():
    clock, seen = Clock(), []
    inbox: queue.Queue = queue.Queue()

    def worker():  # answers each message after 1 virtual second of work
        while (message := inbox.get()) is not None:
            clock.sleep(1.0)
            seen.append((message, clock.now))

    def main():
        thread = threading.Thread(target=worker)
        thread.start()
        for message in ("a", "b"):
            clock.sleep(10.0)
            inbox.put(message)
        clock.sleep(0.5)  # the answer to "b" is still under way
        seen.append(("main", clock.now))
        inbox.put(None)
        thread.join()

    clock.run(main)
    assert seen == [("a", 11.0), ("main", 20.5), ("b", 21.0)]


def test_threads_that_wait_on_each_other_with_nothing_scheduled_are_a_deadlock_naming_where():
    clock = Clock()
    never = threading.Event()

    def main():
        clock.sleep(3.0)
        never.wait()

    with pytest.raises(Deadlock, match=r"t=3\.000 s[\s\S]*never\.wait"):
        clock.run(main)
    never.set()


def test_what_the_target_raises_is_raised_in_the_caller():
    def main():
        raise ValueError("from the schedule")

    with pytest.raises(ValueError, match="from the schedule"):
        Clock().run(main)


def test_a_thread_blocked_outside_the_simulation_is_left_out_and_time_goes_on():
    clock, held = Clock(foreign_s=0.2), threading.Lock()
    held.acquire()

    def main():  # a library's thread, born during the run, blocked in C on a lock never released
        threading.Thread(target=held.acquire, daemon=True).start()
        clock.sleep(2.0)

    with pytest.warns(UserWarning, match="not the simulation's"):
        clock.run(main)
    assert clock.now == 2.0
