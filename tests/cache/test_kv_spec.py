"""KV shape specs: the group record, the parser and the formatter (SPEC §8.2).

Canonical text is rebuilt here field by field (``canonical``), independently of
``format_kv_spec``, and hypothesis renders random groups as messy text (random spacing around
every token, random dtype case) to check both round trips and that every error names its group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec.cache.kv_spec import KV_DTYPES, KVGroupSpec, format_kv_spec, parse_kv_spec

EXAMPLE = "(2,1024,16,8,128):bfloat16:30;(2,1024,16,2,64):bfloat16:2:window=4096"
DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
}
GOOD = "(2,8,4,2,16):float16:3"


def group(**overrides) -> KVGroupSpec:
    fields = dict(
        kv_size=2,
        num_blocks=8,
        block_size=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        layer_count=3,
        window=None,
    )
    fields.update(overrides)
    return KVGroupSpec(**fields)


def canonical(g: KVGroupSpec) -> str:
    text = (
        f"({g.kv_size},{g.num_blocks},{g.block_size},{g.num_kv_heads},{g.head_dim})"
        f":{DTYPE_NAMES[g.dtype]}:{g.layer_count}"
    )
    return text if g.window is None else f"{text}:window={g.window}"


# --------------------------------------------------------------------------------------------
# KVGroupSpec
# --------------------------------------------------------------------------------------------
def test_fields_in_order_with_window_defaulting_to_none():
    names = [f.name for f in dataclasses.fields(KVGroupSpec)]
    assert names == [
        "kv_size",
        "num_blocks",
        "block_size",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "layer_count",
        "window",
    ]
    g = KVGroupSpec(2, 10, 16, 4, 64, torch.bfloat16, 5)
    assert g.window is None


def test_group_is_frozen_and_hashable():
    g = group()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.num_blocks = 9
    assert {g, group()} == {g}


def test_geometry_is_the_grouping_identity():
    g = group(kv_size=1, num_blocks=99, block_size=8, num_kv_heads=4, head_dim=32, window=7)
    assert g.geometry == (1, 4, 32, 8, torch.float16, 7)
    # pool size and layer count are not part of the identity
    assert group(num_blocks=5, layer_count=9).geometry == group().geometry
    assert group(window=3).geometry != group().geometry


@pytest.mark.parametrize(
    ("dtype", "itemsize"),
    [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4), (torch.float8_e4m3fn, 1)],
)
def test_bytes_per_block_and_per_pool(dtype, itemsize):
    g = KVGroupSpec(2, 7, 16, 3, 40, dtype, 5)
    # K and V, 5 layers, 3 heads, 16 tokens, 40 values each
    assert g.block_bytes == 2 * 5 * 3 * 16 * 40 * itemsize
    assert g.nbytes == 7 * g.block_bytes
    assert KVGroupSpec(1, 7, 16, 3, 40, dtype, 5).block_bytes == g.block_bytes // 2


def test_every_kv_dtype_is_accepted():
    assert set(KV_DTYPES) == set(DTYPE_NAMES)
    for dtype in KV_DTYPES:
        assert group(dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    "field", ["kv_size", "num_blocks", "block_size", "num_kv_heads", "head_dim", "layer_count"]
)
@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_int_field_of_wrong_type_is_a_type_error(field, bad):
    with pytest.raises(TypeError, match=field):
        group(**{field: bad})


@pytest.mark.parametrize(
    "field", ["kv_size", "num_blocks", "block_size", "num_kv_heads", "head_dim", "layer_count"]
)
@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_int_field_is_a_value_error(field, bad):
    with pytest.raises(ValueError, match=rf"{field} must be >= 1, got {bad}"):
        group(**{field: bad})


def test_kv_size_must_be_one_or_two():
    with pytest.raises(ValueError, match=r"kv_size must be 1 .* or 2 .*, got 3"):
        group(kv_size=3)


@pytest.mark.parametrize("bad", ["float16", torch.int32, torch.float64, torch.float8_e5m2, None])
def test_dtype_outside_the_kv_dtypes_is_a_type_error(bad):
    with pytest.raises(TypeError, match="dtype must be one of"):
        group(dtype=bad)


def test_window_is_none_or_a_positive_int():
    assert group(window=1).window == 1
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        group(window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        group(window=4.0)
    with pytest.raises(TypeError, match="window must be an int"):
        group(window=True)


# --------------------------------------------------------------------------------------------
# parse_kv_spec / format_kv_spec
# --------------------------------------------------------------------------------------------
def test_the_example_parses_and_formats_back():
    groups = parse_kv_spec(EXAMPLE)
    assert groups == (
        KVGroupSpec(2, 1024, 16, 8, 128, torch.bfloat16, 30),
        KVGroupSpec(2, 1024, 16, 2, 64, torch.bfloat16, 2, window=4096),
    )
    assert format_kv_spec(groups) == EXAMPLE
    assert format_kv_spec(list(groups)) == EXAMPLE


def test_spaces_and_dtype_case_are_accepted_on_input():
    messy = (
        " ( 1 ,8, 4 ,\t2, 16 ) : Float8_E4M3FN :3 ;"
        "(2,1,1,1,1):FLOAT32:1: window = 5 ; (2, 3,5,7,11 ):bfloat16:  2  "
    )
    groups = parse_kv_spec(messy)
    assert groups == (
        KVGroupSpec(1, 8, 4, 2, 16, torch.float8_e4m3fn, 3),
        KVGroupSpec(2, 1, 1, 1, 1, torch.float32, 1, window=5),
        KVGroupSpec(2, 3, 5, 7, 11, torch.bfloat16, 2),
    )
    assert format_kv_spec(groups) == (
        "(1,8,4,2,16):float8_e4m3fn:3;(2,1,1,1,1):float32:1:window=5;(2,3,5,7,11):bfloat16:2"
    )


def test_leading_zeros_are_dropped_in_the_canonical_form():
    groups = parse_kv_spec("(02,008,4,2,16):float16:03:window=0032")
    assert groups == (group(num_blocks=8, window=32),)
    assert format_kv_spec(groups) == "(2,8,4,2,16):float16:3:window=32"


# (spec, index of the bad group, the bad group's text as named in the message, what is wrong)
ERRORS = [
    ("", 0, "", "the spec is empty"),
    ("  \t ", 0, "  \t ", "the spec is empty"),
    (f"{GOOD};", 1, "", "trailing ';'"),
    (f"{GOOD};{GOOD}; ", 2, "", "trailing ';'"),
    (f"{GOOD};;{GOOD}", 1, "", "extra ';'"),
    (f";{GOOD}", 0, "", "extra ';'"),
    ("(2,8,4,2):float16:3", 0, "(2,8,4,2):float16:3", "expected 5 .* got 4"),
    (f"{GOOD};(2,8,4,2,16,1):float16:3", 1, "(2,8,4,2,16,1):float16:3", "expected 5 .* got 6"),
    ("(2,8,4,,16):float16:3", 0, "(2,8,4,,16):float16:3", "num_kv_heads .* got ''"),
    ("(2,8,x,2,16):float16:3", 0, "(2,8,x,2,16):float16:3", "block_size .* integer, got 'x'"),
    ("(2,8,4,2,1.5):float16:3", 0, "(2,8,4,2,1.5):float16:3", "head_dim .* got '1.5'"),
    ("(2,-8,4,2,16):float16:3", 0, "(2,-8,4,2,16):float16:3", "num_blocks .* got '-8'"),
    ("(2,8,4,2,1 6):float16:3", 0, "(2,8,4,2,1 6):float16:3", "head_dim .* got '1 6'"),
    ("(2,0,4,2,16):float16:3", 0, "(2,0,4,2,16):float16:3", "num_blocks must be >= 1, got 0"),
    ("(2,8,4,2,16):float16:0", 0, "(2,8,4,2,16):float16:0", "layer_count must be >= 1, got 0"),
    ("(2,8,4,2,16):float16:three", 0, "(2,8,4,2,16):float16:three", "layer_count .* 'three'"),
    (f"{GOOD};(3,8,4,2,16):float16:3", 1, "(3,8,4,2,16):float16:3", "kv_size must be 1"),
    ("(0,8,4,2,16):float16:3", 0, "(0,8,4,2,16):float16:3", "kv_size must be >= 1, got 0"),
    ("(2,8,4,2,16):fp16:3", 0, "(2,8,4,2,16):fp16:3", "unknown dtype 'fp16'; expected one of"),
    ("(2,8,4,2,16):int8:3", 0, "(2,8,4,2,16):int8:3", "unknown dtype 'int8'"),
    ("(2,8,4,2,16)::3", 0, "(2,8,4,2,16)::3", "unknown dtype ''"),
    (f"{GOOD}:window=0", 0, f"{GOOD}:window=0", "window must be >= 1, got 0"),
    (f"{GOOD}:window=-2", 0, f"{GOOD}:window=-2", "window .* integer, got '-2'"),
    (f"{GOOD}:window=", 0, f"{GOOD}:window=", "window .* integer, got ''"),
    (f"{GOOD}:win=4", 0, f"{GOOD}:win=4", "expected 'window=N'"),
    (f"{GOOD}:Window=4", 0, f"{GOOD}:Window=4", "expected 'window=N'"),
    (f"{GOOD}:window 4", 0, f"{GOOD}:window 4", "expected 'window=N'"),
    (f"{GOOD}:4", 0, f"{GOOD}:4", "expected 'window=N'"),
    (f"{GOOD}:window=4:x", 0, f"{GOOD}:window=4:x", "after '\\)', got ':float16:3:window=4:x'"),
    (f"{GOOD}:window=4x", 0, f"{GOOD}:window=4x", "window .* got '4x'"),
    ("(2,8,4,2,16):float16", 0, "(2,8,4,2,16):float16", "expected ':dtype:layer_count"),
    ("(2,8,4,2,16)", 0, "(2,8,4,2,16)", "expected ':dtype:layer_count"),
    ("(2,8,4,2,16)float16:3", 0, "(2,8,4,2,16)float16:3", "unexpected 'float16' after"),
    ("2,8,4,2,16):float16:3", 0, "2,8,4,2,16):float16:3", "expected '\\(' to open"),
    ("x(2,8,4,2,16):float16:3", 0, "x(2,8,4,2,16):float16:3", "expected '\\(' to open"),
    ("(2,8,4,2,16:float16:3", 0, "(2,8,4,2,16:float16:3", "missing '\\)'"),
    ("(2,8,4,2,16)):float16:3", 0, "(2,8,4,2,16)):float16:3", "unexpected '\\)' after"),
    (f"{GOOD} {GOOD}", 0, f"{GOOD} {GOOD}", "expected ':dtype:layer_count.* got ':float16:3 \\(2"),
]


@pytest.mark.parametrize(("spec", "index", "text", "what"), ERRORS)
def test_errors_name_the_group_index_its_text_and_what_is_wrong(spec, index, text, what):
    with pytest.raises(ValueError, match=what) as info:
        parse_kv_spec(spec)
    assert f"KV spec group {index} {text.strip()!r}:" in str(info.value)


@pytest.mark.parametrize("bad", [None, b"(2,8,4,2,16):float16:3", 3, ["(2,8,4,2,16):float16:3"]])
def test_parse_takes_only_a_str(bad):
    with pytest.raises(TypeError, match="spec must be a str"):
        parse_kv_spec(bad)


def test_format_rejects_anything_but_a_non_empty_sequence_of_groups():
    with pytest.raises(ValueError, match="at least one KVGroupSpec"):
        format_kv_spec([])
    with pytest.raises(ValueError, match="at least one KVGroupSpec"):
        format_kv_spec(())
    for bad in (GOOD, group(), iter([group()]), {group()}, None):
        with pytest.raises(TypeError, match="groups must be a sequence of KVGroupSpec"):
            format_kv_spec(bad)
    groups = [group(), group(window=4), GOOD]
    with pytest.raises(TypeError, match=r"groups\[2\] must be a KVGroupSpec, got str"):
        format_kv_spec(groups)
    assert groups == [group(), group(window=4), GOOD]  # the rejected call changed nothing


# --------------------------------------------------------------------------------------------
# properties on generated specs
# --------------------------------------------------------------------------------------------
sizes = st.integers(1, 100_000)
groups_st = st.builds(
    KVGroupSpec,
    kv_size=st.sampled_from([1, 2]),
    num_blocks=sizes,
    block_size=sizes,
    num_kv_heads=sizes,
    head_dim=sizes,
    dtype=st.sampled_from(list(DTYPE_NAMES)),
    layer_count=sizes,
    window=st.none() | sizes,
)
group_lists = st.lists(groups_st, min_size=1, max_size=5)
pad = st.text(alphabet=" \t", max_size=2)


@st.composite
def messy_text(draw, g: KVGroupSpec) -> str:
    """``g`` as input text: random spaces around every token and a random dtype case."""
    name = DTYPE_NAMES[g.dtype]
    upper = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    dtype = "".join(c.upper() if u else c for c, u in zip(name, upper, strict=True))
    shape = [g.kv_size, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim]
    parts = [draw(pad), "(", draw(pad)]
    for i, value in enumerate(shape):
        parts += [",", draw(pad)] if i else []
        parts += [str(value), draw(pad)]
    parts += [")", draw(pad), ":", draw(pad), dtype, draw(pad), ":", draw(pad)]
    parts += [str(g.layer_count), draw(pad)]
    if g.window is not None:
        parts += [":", draw(pad), "window", draw(pad), "=", draw(pad), str(g.window), draw(pad)]
    return "".join(parts)


@st.composite
def messy_specs(draw) -> tuple[list[KVGroupSpec], str]:
    groups = draw(group_lists)
    return groups, ";".join(draw(messy_text(g)) for g in groups)


@settings(max_examples=200, deadline=None)
@given(messy_specs())
def test_parse_then_format_gives_the_canonical_form(case):
    groups, text = case
    assert format_kv_spec(parse_kv_spec(text)) == ";".join(canonical(g) for g in groups)
    assert parse_kv_spec(text) == tuple(groups)


@settings(max_examples=200, deadline=None)
@given(group_lists)
def test_format_then_parse_gives_the_groups_back(groups):
    text = format_kv_spec(groups)
    assert text == ";".join(canonical(g) for g in groups)
    assert parse_kv_spec(text) == tuple(groups)


# one-group corruptions, each breaking a rule of the grammar or of KVGroupSpec's values
CORRUPTIONS = {
    "field count": lambda t: t.replace(",", ",1,", 1),
    "zero field": lambda t: "(0" + t[t.index(",") :],
    "non-integer field": lambda t: t.replace(",", ",x", 1),
    "kv_size 3": lambda t: "(3" + t[t.index(",") :],
    "unknown dtype": lambda t: t.replace("):", "):f16", 1),
    "window 0": lambda t: t.split(":window=")[0] + ":window=0",
    "window key": lambda t: t.split(":window=")[0] + ":windows=4",
    "junk after window": lambda t: t.split(":window=")[0] + ":window=4:x",
    "no parentheses": lambda t: t.replace("(", "", 1),
    "no colon": lambda t: t.replace("):", ")", 1),
}


@settings(max_examples=200, deadline=None)
@given(
    group_lists,
    st.data(),
    st.sampled_from(sorted(CORRUPTIONS)),
)
def test_a_bad_group_anywhere_fails_the_whole_parse_and_is_named(groups, data, corruption):
    texts = [canonical(g) for g in groups]
    index = data.draw(st.integers(0, len(texts) - 1))
    texts[index] = CORRUPTIONS[corruption](texts[index])
    with pytest.raises(ValueError) as info:
        parse_kv_spec(";".join(texts))
    assert f"KV spec group {index} {texts[index]!r}:" in str(info.value)


@settings(max_examples=50, deadline=None)
@given(group_lists)
def test_a_trailing_semicolon_fails_the_whole_parse(groups):
    text = format_kv_spec(groups) + ";"
    with pytest.raises(ValueError, match=f"KV spec group {len(groups)} '': .*trailing ';'"):
        parse_kv_spec(text)
