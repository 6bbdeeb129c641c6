"""Measurement: fidelity against the backbone (teacher-forced), speed, prompts."""
