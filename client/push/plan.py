"""``weightwire.client.inputs.plan`` under the path it had before the client was layered (scripts
import it from here); this name and that one are the same module object."""

import sys

from weightwire.client.inputs import plan

sys.modules[__name__] = plan
