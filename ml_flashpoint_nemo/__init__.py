"""ml_flashpoint_nemo."""
