"""The command line's own parsing: sizes for memory budgets."""

from __future__ import annotations

import argparse

import pytest

from plexrl.cli import parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 << 30), ("512MB", 512 * 10**6), ("2e6", 2_000_000), ("1.5 KiB", 1536), ("0", 0), ("7b", 7)],
)
def test_sizes_parse_with_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "-1GB", ""])
def test_a_bad_size_says_how_to_write_one(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        parse_bytes(text)
