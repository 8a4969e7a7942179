"""mbridge bridges for models that mbridge 0.15.1 does not support (registered by verl_npu.runtime_patches)."""

# mbridge first: importing it applies verl-npu's registration patch (runtime_patches.mbridge_glm5), which
# imports the bridge modules here. Were a bridge module's own import of mbridge the first one, the patch
# would find that module half-initialised.
import mbridge  # noqa: F401
