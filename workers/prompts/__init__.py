"""`sprawl prompts`: the run's task's prompt groups published ahead of the trainer, as a worker of its own
(on Kubernetes, where no `sprawl up` runs beside the trainer)."""
