"""Dataset and model references parse and print in one place: round trips and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuyard.errors import ConfigError
from gpuyard.refs import DatasetRef, ModelRef, import_ref

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("digits", DatasetRef("digits")),
        ("digits@3f2a9c01b7de", DatasetRef("digits", "3f2a9c01b7de")),
        ("digits@3f2a#split=train", DatasetRef("digits", "3f2a", ("train",))),
        ("my.set_1-b#split=test,train", DatasetRef("my.set_1-b", None, ("test", "train"))),
    ],
)
def test_dataset_refs_round_trip(text: str, ref: DatasetRef) -> None:
    assert DatasetRef.parse(text) == ref
    assert str(ref) == text
    assert DatasetRef.parse(str(ref)) == ref


def test_latest_is_the_newest_version_and_spaces_around_split_names_go() -> None:
    assert DatasetRef.parse("digits@latest") == DatasetRef("digits")
    assert str(DatasetRef.parse("digits@latest#split= train , val")) == "digits#split=train,val"


def test_selection_is_replaced_and_dropped() -> None:
    ref = DatasetRef.parse("x@abcd#split=test")
    assert str(ref.with_splits(["train", "val"])) == "x@abcd#split=train,val"
    assert ref.base == DatasetRef("x", "abcd") and str(ref.with_splits(None)) == "x@abcd"
    # parse_base ignores the selection, well formed or not: with_splits replaces it anyway.
    assert DatasetRef.parse_base("x@abcd#nonsense") == DatasetRef("x", "abcd")
    assert DatasetRef.has_selection("x#") and not DatasetRef.has_selection("x@abcd")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "dataset name ''"),
        ("a/b", "dataset name 'a/b'"),
        ("-x", "dataset name '-x'"),
        ("x" * 129, "at most 128"),
        ("x@1", "version must be 4-64 hex digits or 'latest'"),
        ("x@ABCD", "version must be 4-64 hex digits"),
        ("x@abcd#split=", "use NAME[@VERSION]#split=NAME[,NAME...]"),
        ("x#splits=train", "use NAME[@VERSION]#split="),
        ("x#split=a,,b", "use NAME[@VERSION]#split="),
        ("x#split=train#x", "use NAME[@VERSION]#split="),
        ("x#split=a,a", "a split is named twice"),
    ],
)
def test_bad_dataset_refs_are_one_line_config_errors(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        DatasetRef.parse(text)
    assert problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "ref", "selector"),
    [
        ("mnist", ModelRef("mnist"), None),
        ("mnist:3", ModelRef("mnist", version=3), 3),
        ("mnist@production", ModelRef("mnist", alias="production"), "production"),
        ("a.b-c_d@champion-2", ModelRef("a.b-c_d", alias="champion-2"), "champion-2"),
    ],
)
def test_model_refs_round_trip(text: str, ref: ModelRef, selector: int | str | None) -> None:
    assert ModelRef.parse(text) == ref and str(ref) == text and ref.selector == selector


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("mnist:0", "version must be a positive integer"),
        ("mnist:x", "version must be a positive integer"),
        ("mnist:", "version must be a positive integer"),
        ("mnist@1st", "alias '1st' must start with a letter"),
        ("mnist@", "alias '' must start with a letter"),
        ("no such", "model name 'no such'"),
        ("@prod", "model name ''"),
    ],
)
def test_bad_model_refs_are_one_line_config_errors(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelRef.parse(text)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_import_ref_errors_say_which_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError,
        match=r"model.entrypoint: cannot import module 'no_such_mod_xyz'.*"
        r"ModuleNotFoundError",
    ):
        import_ref("no_such_mod_xyz:build", "model.entrypoint")
    # A module that exists but fails while importing: the user's own exception is named.
    (tmp_path / "broken_factory_mod.py").write_text("raise ValueError('bad constant')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="ValueError: bad constant"):
        import_ref("broken_factory_mod:f", "data.train.entrypoint")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        import_ref("gpuyard.train.examples:nope")
    with pytest.raises(ConfigError, match="not of the form"):
        import_ref("gpuyard.train.examples.mlp")
    assert import_ref("gpuyard.train.examples:mlp")().__class__.__name__ == "Sequential"
    assert import_ref("gpuyard.refs:DatasetRef.parse")("x") == DatasetRef("x")  # a dotted attribute
    with pytest.raises(ConfigError, match=r"trainer: 'gpuyard.refs:NAME_RE' is a Pattern, not a callable"):
        import_ref("gpuyard.refs:NAME_RE", "trainer")
