"""The litertlm target: its record and runnable (``target``) and what only it uses."""
