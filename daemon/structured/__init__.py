"""Constrained decoding: what a request's output must match, compiled by llguidance."""
