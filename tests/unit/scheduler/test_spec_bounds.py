"""Job spec bounds (command, env, paths, workload) and the linear shell-word splitter."""

from __future__ import annotations

import random
import shlex

import pytest

from gpuyard.errors import ConfigError
from gpuyard.scheduler.spec import MAX_COMMAND_CHARS, parse_spec, split_command

pytestmark = pytest.mark.unit


def _split_or_error(split: object, text: str) -> object:
    try:
        return split(text)  # type: ignore[operator]
    except ValueError:
        return "error"


def test_split_command_agrees_with_shlex_on_random_text() -> None:
    rnd = random.Random(18)
    alphabet = "ab '\"\\\t\n\r#$*"
    for _ in range(20000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 14)))
        assert _split_or_error(split_command, text) == _split_or_error(shlex.split, text), repr(text)
    assert split_command("python -c 'print(1)' \"a \\\"b\\\" \\c\" x\\ y ''") == [
        "python",
        "-c",
        "print(1)",
        'a "b" \\c',
        "x y",
        "",
    ]
    for bad in ("echo 'open", 'echo "open', "echo \\"):
        with pytest.raises(ValueError):
            split_command(bad)


def test_split_command_reads_whole_runs_so_a_megabyte_word_is_one_piece() -> None:
    # shlex grows a word one character at a time (quadratic: about 40 s on one 2 MB word). The
    # splitter's regular expression takes each run of plain characters, and each quoted string, as one
    # piece: its work is the pieces' count plus one join per word, so it is linear in the text. The
    # count is asserted here, not a time (the speed itself is no test's business).
    from gpuyard.scheduler.spec import _PIECE

    n = MAX_COMMAND_CHARS
    quoted = '"' + 'a\\"' * 300_000 + '"'
    for text, pieces, words in (
        ("a" * n, 1, ["a" * n]),
        (quoted, 1, ['a"' * 300_000]),
        ("a " * (n // 2), n, ["a"] * (n // 2)),
    ):
        assert sum(1 for _ in _PIECE.finditer(text)) == pieces
        assert split_command(text) == words


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"command": "x" * (MAX_COMMAND_CHARS + 1)}, "command: Value error, at most 1048576 characters"),
        ({"command": ["a" * (128 * 1024 + 1)]}, "command.0: String should have at most 131072"),
        ({"command": ["a"] * 4097}, "command: List should have at most 4096"),
        ({"command": ["a"], "env": {str(i): "" for i in range(1025)}}, "env: Dictionary should have at most"),
        ({"command": ["a"], "env": {"": "x"}}, "env..[key]: String should have at least 1"),
        ({"command": ["a" * 100_000] * 11}, "command and env hold 1100000 characters together"),
        (
            {"command": ["a"], "env": {"A": "b" * 100_000, **{f"K{i}": "v" * 100_000 for i in range(10)}}},
            "env",
        ),
        ({"command": ["a"], "workdir": "w" * 4097}, "workdir"),
        ({"command": ["a"], "checkpoint_dir": "c" * 4097}, "checkpoint_dir"),
        ({"train": "t" * 4097}, "train"),
        ({"command": ["a"], "resources": {"memory_gb": float("inf")}}, "resources.memory_gb"),
        ({"command": ["a"], "resources": {"gpu_type": "g" * 101}}, "resources.gpu_type"),
        ({"command": ["a"], "workload": {"model": "m", "global_batch": 2**70}}, "workload.global_batch"),
        ({"command": ["a"], "workload": {"model": "m" * 101, "global_batch": 1}}, "workload.model"),
        (
            {"command": ["a"], "workload": {"model": "m", "global_batch": 8, "layout": {"tp": 2**40}}},
            "workload.layout.tp",
        ),
        (
            {
                "command": ["a"],
                "workload": {
                    "model": {"layers": 2**40, "hidden": 8, "heads": 1, "ffn_hidden": 8, "vocab": 8},
                    "global_batch": 8,
                },
            },
            "layers: Input should be less than or equal to 100000",
        ),
    ],
)
def test_oversized_specs_are_refused_naming_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec({"name": "x", **doc})
    assert field in str(err.value)
    assert len(str(err.value)) < 2000  # the message names the field; it does not echo the input


def test_a_spec_at_the_bounds_is_accepted() -> None:
    spec = parse_spec({"name": "x", "command": "echo " + "a" * (128 * 1024), "env": {"K": "v" * 1000}})
    assert spec.command is not None and len(spec.command[1]) == 128 * 1024
