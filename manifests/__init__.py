"""Manifest JSON Schema and example bucket configs, shipped as package data."""
