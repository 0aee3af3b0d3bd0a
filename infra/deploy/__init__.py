"""Manifests and launchers that run sprawl beyond one machine (Kubernetes, SkyPilot, Modal), and
the checks that keep them true to the code."""
