"""The parallel runtime, the bottom layer: the layout, fleet's groups for it, job launch, and the
Paddle internals replaced on CPU. Nothing here imports a model, the checkpoint or the trainer."""
