"""The property of test_properties.py through the container's /run.sh modes: whatever
the bytes, one unbroken output line per input line, in order, the same in CPU-1
throughput, CPU-ALL throughput and latency, and equal to `python -m decoder`.
A few examples only: each costs three container starts."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_container import ONE, ONE_LATENCY, chosen_precision, image, model_dir, reference, run  # noqa: F401 (fixtures)
from test_properties import BREAKS, n_lines, stdins

pytestmark = pytest.mark.slow


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(stdins, min_size=1, max_size=4).map(b"".join))
def test_run_sh_modes_give_one_unbroken_line_per_input_line_as_the_cli(image, model_dir, data):  # noqa: F811
    for mode in (["CPU-1", "throughput"], ["CPU-ALL", "throughput"], ["CPU-1", "latency"]):
        r = run(image, ["/run.sh", *mode], data)
        assert r.exit_code == 0, (mode, r.stderr)
        # auto's timing probe may pick either precision on a loaded host (test_container)
        # one CLI run per (task, precision): reference() keeps each, so the two throughput modes share it
        want = reference(model_dir, data, ONE_LATENCY if mode[1] == "latency" else ONE, chosen_precision(r.stderr))
        assert want.count(b"\n") == n_lines(data)
        assert not any(BREAKS & set(x) for x in want.decode("utf-8").split("\n")[:-1])
        assert r.stdout == want, mode
