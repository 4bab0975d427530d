"""Hypothesis settings and input generators shared by the fuzz tests.

Example counts are modest so the 2-core CI stays fast; ``SERVEPILOT_FUZZ_EXAMPLES=5000`` (or any number)
turns the same tests into a longer local fuzzing run. No deadline: a slow example on a loaded CI machine is
not a failure, a crash or a wrong answer is.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("SERVEPILOT_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("CI") == "true",  # CI reruns are reproducible; local runs keep exploring
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_NAME = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,30}", fullmatch=True)
_LABEL_VALUE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e308", "9223372036854775807", "0x10", "", "one", "1_0"]),
    st.integers(-(2**70), 2**70).map(str),
)


@st.composite
def sample_line(draw: st.DrawFn) -> str:
    """One sample line, usually well formed, sometimes with bad escapes, values or timestamps."""
    name = draw(_NAME)
    labels = draw(st.dictionaries(_NAME.filter(lambda n: ":" not in n), _LABEL_VALUE, max_size=3))
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    suffix = draw(st.sampled_from(["", "_total", "_bucket", "_count", "_sum", "_created"]))
    if suffix == "_bucket":
        body = ",".join(filter(None, [body, f'le="{draw(st.sampled_from(["0.1", "1", "+Inf", "x"]))}"']))
    timestamp = draw(st.sampled_from(["", " 1700000000000", " -1", " nope"]))
    return f"{name}{suffix}{{{body}}} {draw(_VALUE)}{timestamp}"


@st.composite
def exposition_text(draw: st.DrawFn) -> str:
    """Text that looks like Prometheus exposition: TYPE/HELP comments, samples, junk, odd line endings."""
    lines = draw(
        st.lists(
            st.one_of(
                sample_line(),
                st.builds(
                    lambda n, t: f"# TYPE {n} {t}",
                    _NAME,
                    st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "bogus"]),
                ),
                st.builds(lambda n, h: f"# HELP {n} {h}", _NAME, st.text(max_size=30)),
                st.text(max_size=40),
            ),
            max_size=40,
        )
    )
    return draw(st.sampled_from(["\n", "\r\n", "\n\n"])).join(lines)


@st.composite
def mutated(draw: st.DrawFn, text: str) -> str:
    """A real exposition with lines dropped, duplicated, cut short or overwritten: a scrape gone wrong."""
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 8))):
        if not lines:
            break
        at = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "dup", "cut", "junk", "value"]))
        if action == "drop":
            del lines[at]
        elif action == "dup":
            lines.insert(at, lines[at])
        elif action == "cut":
            lines[at] = lines[at][: draw(st.integers(0, max(0, len(lines[at]) - 1)))]
        elif action == "junk":
            lines[at] = draw(st.text(max_size=40))
        else:
            head, _, _ = lines[at].rpartition(" ")
            lines[at] = f"{head} {draw(_VALUE)}"
    return "\n".join(lines) + draw(st.sampled_from(["", "\n"]))
