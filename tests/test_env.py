"""The environment filter (isolate/_core/env.py) on its own: what passes, what is withheld and
the reason each withheld name is given, and the line the episode's log shows for them."""

from __future__ import annotations

from isolate._core import env as _env


def test_an_interpreter_setting_is_withheld_with_its_own_reason() -> None:
    parent = {"PYTHONPATH": "/trainer", "LD_PRELOAD": "libx.so", "HOME": "/root"}
    passed, withheld = _env.split_env(parent, _env.PASSTHROUGH_ENV)
    assert passed == {"HOME": "/root"}
    assert withheld == {
        "PYTHONPATH": _env.INTERPRETER_ENV["PYTHON*"],
        "LD_PRELOAD": _env.INTERPRETER_ENV["LD_PRELOAD"],
    }


def test_an_exclusion_of_the_callers_names_itself_as_the_reason() -> None:
    passed, withheld = _env.split_env({"FOO_X": "1", "BAR": "2"}, ("*", "!FOO_*"))
    assert passed == {"BAR": "2"}
    assert withheld == {"FOO_X": "excluded by inherit_env '!FOO_*'"}


def test_the_withheld_line_groups_names_by_reason_and_shows_no_value() -> None:
    withheld = {
        "B_TOKEN": _env.CREDENTIAL,
        "A_API_KEY": _env.CREDENTIAL,
        "PYTHONPATH": _env.INTERPRETER_ENV["PYTHON*"],
    }
    assert _env.describe_withheld(withheld) == (
        "withheld from the agent's environment: A_API_KEY, B_TOKEN (looks like a credential); "
        "PYTHONPATH (steers Python) (isolate doctor)"
    )
