"""Verification a user runs on a spec: the generated kernel against the reference, layer by layer
(kernel), then compiled by libtpu."""
