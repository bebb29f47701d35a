"""The DFlash drafter: the model (v1 and DFlash2), its configuration and checkpoint files in z-lab's format, its
rotary embedding and its draft vocabulary."""
