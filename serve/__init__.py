"""Serve stage: MPI-launched workers, readiness gates, OpenAI-compatible endpoint."""
