"""Tests of the HF drop-in (issue 8)."""
