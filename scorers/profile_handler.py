"""single-profile-handler: accepted so Inference Extension configs load unchanged.

smart-epp runs one profile per request (the first, or the one the scheduler is built
with), which is what this handler does in the Inference Extension.
"""

from __future__ import annotations

from ..framework.plugins import ProfileHandler
from ..framework.registry import register_plugin


@register_plugin()
class SingleProfileHandler(ProfileHandler):
    type_name = "single-profile-handler"
