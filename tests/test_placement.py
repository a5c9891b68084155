"""Slowdown profiles (D1): coverage of paper Table 4, sources, and the Gavel derivation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.placement import (
    ProfileError,
    ShapeOnTop,
    canonical_shape,
    load_profiles,
    locality_of,
    model_slowdown,
    slowdown_of,
)

TABLE_4 = ["inception-v3", "alexnet", "resnet50", "vgg16", "vgg19", "bidaf", "lm", "gnmt", "transformer",
           "wavenet", "deepspeech"]
ROOT = Path(__file__).resolve().parents[1]


def test_every_table_4_model_has_a_sourced_profile():
    profiles = load_profiles()
    assert set(TABLE_4) <= set(profiles)
    for name in TABLE_4:
        p = profiles[name]
        assert p.source and p.category in {"cv", "nlp", "speech"}
        assert p.slowdown[0] == 1.0 and all(a <= b for a, b in zip(p.slowdown, p.slowdown[1:]))
    assert {profiles[m].category for m in ("bidaf", "lm", "gnmt", "transformer")} == {"nlp"}


def test_gavel_derived_values_match_the_shipped_table():
    spec = importlib.util.spec_from_file_location("derive", ROOT / "scripts" / "derive_slowdowns.py")
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    derived = derive.derive("p100")
    profiles = load_profiles()
    for name, values in derived.items():
        assert profiles[name].slowdown == pytest.approx(values), name
    assert profiles["lm"].slowdown[2] > profiles["transformer"].slowdown[2] > profiles["resnet50"].slowdown[2]


def test_slowdown_depends_on_level_only():
    s = model_slowdown("vgg16")
    one_machine = [("r0", "m0", "s0"), ("r0", "m0", "s1")]
    one_rack = [("r0", "m0", "s0"), ("r0", "m1", "s0")]
    spread = [("r0", "m0", "s0"), ("r1", "m5", "s0")]
    assert slowdown_of(s, [("r0", "m0", "s0")]) == 1.0
    assert slowdown_of(s, one_machine) == s[1]
    assert slowdown_of(s, one_rack) == s[2] == pytest.approx(1 / 0.72, abs=1e-3)
    assert slowdown_of(s, spread) == s[3]
    assert [locality_of(x) for x in (one_machine, one_rack, spread)] == [1, 2, 3]


def test_canonical_shape_ignores_names_but_not_structure():
    a = [("r0", "m0", "s0"), ("r0", "m0", "s0"), ("r1", "m3", "s1")]
    b = [("r7", "m9", "s2"), ("r2", "m1", "s4"), ("r2", "m1", "s4")]
    c = [("r0", "m0", "s0"), ("r0", "m0", "s1"), ("r1", "m3", "s1")]
    assert canonical_shape(a) == canonical_shape(b)
    assert canonical_shape(a) != canonical_shape(c)


_cells = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 2)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_cells, st.lists(_cells, min_size=1, max_size=4))
def test_a_shape_on_top_of_held_gpus_is_the_canonical_shape_of_both(held, extras):
    """``ShapeOnTop`` reuses the held set's racks and machines; whatever a row adds (GPUs in held
    slots, machines or racks, or new ones), the shape must be ``canonical_shape`` of the union."""
    def positions(cells):
        return [(f"r{r}", f"r{r}m{m}", f"s{k}") for r, m, k in cells]

    on_top = ShapeOnTop(positions(held))
    assert on_top([]) == canonical_shape(positions(held))
    for extra in extras:
        assert on_top(positions(extra)) == canonical_shape(positions(held) + positions(extra))


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.x]\ncategory='cv'\nslowdown=[1,1,1]\nsource='s'", "list of 4 numbers"),
        ("[models.x]\ncategory='cv'\nslowdown=[1,1,0.5,2]\nsource='s'", r"slowdown\[2\] must be a number >= 1"),
        ("[models.x]\ncategory='cv'\nslowdown=[1,2,1.5,2]\nsource='s'", "must not decrease"),
        ("[models.x]\ncategory='cv'\nslowdown=[1,1,1,1]", "source must say"),
        ("[models.x]\ncategory='maths'\nslowdown=[1,1,1,1]\nsource='s'", "category"),
        ("nothing = 1", r"\[models\]"),
    ],
)
def test_bad_profile_tables_say_what_and_where(tmp_path, text, message):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        load_profiles(path)
    assert str(path) in str(info.value)


def test_unknown_model_is_named():
    with pytest.raises(ProfileError, match="unknown model 'bert'"):
        model_slowdown("bert")
