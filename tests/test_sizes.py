"""Size and age parsing: what users type, and the one-line errors for what they mistype."""

from __future__ import annotations

import pytest

from shmstage.sizes import SizeError, format_size, mount_size, parse_age, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64G", 64 << 30),
        ("64GiB", 64 << 30),
        ("64g", 64 << 30),
        ("512M", 512 << 20),
        ("1.5G", int(1.5 * (1 << 30))),
        ("1GB", 10**9),
        ("4096", 4096),
        ("0", 0),
        ("10K", 10240),
        ("1 T", 1 << 40),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


def test_percent_needs_a_base_and_resolves_against_it():
    assert parse_size("50%", percent_of=1000) == 500
    with pytest.raises(SizeError, match="percentage is not allowed"):
        parse_size("50%")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("12Q", "unknown unit 'Q'"),
        ("-5G", "must not be negative"),
        ("abc%", "invalid size 'abc%'"),
        ("", "invalid size ''"),
        ("150%", "percentage must be in (0, 100]"),
        ("0%", "percentage must be in (0, 100]"),
    ],
)
def test_bad_sizes_are_rejected_with_reason(text, message):
    with pytest.raises(SizeError) as info:
        parse_size(text, percent_of=100)
    assert message in str(info.value)
    assert info.value.exit_code == 2


def test_format_and_mount_size():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(100) == "100 B"
    assert mount_size(64 << 30) == "64G"
    assert mount_size(1536 << 20) == "1536M"
    assert mount_size(1000) == "1000"


def test_parse_age():
    assert parse_age("7d") == 7 * 86400
    assert parse_age("90") == 90
    with pytest.raises(SizeError, match="invalid age"):
        parse_age("yesterday")
