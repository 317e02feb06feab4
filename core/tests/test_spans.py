import threading
import warnings

import pytest
from skip_core import spans


class Collect:
    """A sink that keeps the names of the spans it received."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def end(self, span) -> None:
        self.names.append(span.name)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class FailOn(Collect):
    """A sink that raises on the span named ``name`` (at its start or its end)."""

    def __init__(self, name: str, at: str = "end") -> None:
        super().__init__()
        self.name, self.at = name, at
        setattr(self, at, self._maybe_fail)

    def _maybe_fail(self, span) -> None:
        if span.name == self.name:
            raise RuntimeError(f"sink broke on {span.name}")
        if self.at == "end":
            self.names.append(span.name)


@pytest.fixture(autouse=True)
def _no_sinks():
    spans.close()
    yield
    spans.close()


def emit(*names: str) -> None:
    for name in names:
        with spans.span(name):
            pass


@pytest.mark.parametrize("at", ["end", "start"])
def test_a_failing_sink_does_not_keep_spans_from_the_sinks_after_it(at):
    broken, healthy = FailOn("b", at=at), Collect()
    spans.attach(broken)
    spans.attach(healthy)
    with pytest.warns(RuntimeWarning, match="span sink .*FailOn.* failed and is switched off.*sink broke on b"):
        emit("a", "b", "c")
    assert healthy.names == ["a", "b", "c"]
    if at == "end":
        assert broken.names == ["a"]  # switched off from the failure on


def test_a_failing_sink_is_reported_once_even_from_many_threads():
    broken, healthy = FailOn("x"), Collect()
    spans.attach(broken)
    spans.attach(healthy)
    start = threading.Barrier(8)

    def work():
        start.wait()
        emit(*["x"] * 50)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len([w for w in caught if "switched off" in str(w.message)]) == 1
    assert len(healthy.names) == 400


def test_spans_are_no_ops_once_the_only_sink_is_switched_off():
    spans.attach(FailOn("a"))
    with pytest.warns(RuntimeWarning):
        emit("a")
    assert not spans.enabled()
    assert spans.span("b") is spans.span("c")  # the shared no-op
