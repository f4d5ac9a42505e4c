"""Build stage: checkpoint -> immutable, content-addressed, tensor-parallel engine."""
