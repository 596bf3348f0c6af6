"""The environment filter (isolate/_core/system/env.py) on its own: what passes, what is
withheld and the reason each withheld name is given, and the line the episode's log shows
for them."""

from __future__ import annotations

from isolate._core.system import env as _env

CREDENTIAL = "looks like a credential: pass it with secret_env, or name it in inherit_env"


def test_an_interpreter_setting_is_withheld_with_its_own_reason() -> None:
    parent = {"PYTHONPATH": "/trainer", "LD_PRELOAD": "libx.so", "HOME": "/root"}
    passed, withheld = _env.split_env(parent, _env.PASSTHROUGH_ENV)
    assert passed == {"HOME": "/root"}
    assert withheld == {
        "PYTHONPATH": "steers Python: the trainer's setting would apply to the agent's interpreter",
        "LD_PRELOAD": "preloads a library into every process the agent starts",
    }


def test_an_exclusion_of_the_callers_names_itself_as_the_reason() -> None:
    passed, withheld = _env.split_env({"FOO_X": "1", "BAR": "2"}, ("*", "!FOO_*"))
    assert passed == {"BAR": "2"}
    assert withheld == {"FOO_X": "excluded by inherit_env '!FOO_*'"}


def test_the_withheld_line_groups_names_by_reason_and_shows_no_value() -> None:
    withheld = {
        "B_TOKEN": CREDENTIAL,
        "A_API_KEY": CREDENTIAL,
        "PYTHONPATH": "steers Python: the trainer's setting would apply to the agent's interpreter",
    }
    assert _env.describe_withheld(withheld) == (
        "withheld from the agent's environment: A_API_KEY, B_TOKEN (looks like a credential); "
        "PYTHONPATH (steers Python) (isolate doctor)"
    )
