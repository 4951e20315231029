"""Parallelism: process groups, token dispatch/combine backends, pipeline schedules and runtime."""
