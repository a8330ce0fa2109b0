"""paddle-pp's runtime and training layers (see docs/architecture.md).

`paddle_pp.runtime` is the bottom layer (layout, topology, launch, Paddle backends); models,
then the unified checkpoint, build on it; `paddle_pp.training` and `paddle_pp.data` sit on top.
"""

from paddle_pp.runtime.host_memory import keep_freed_memory
from paddle_pp.runtime.startup import quiet_known_notes

quiet_known_notes()
keep_freed_memory()
