"""Offline planning: what a layout holds per rank, before any process starts."""
