"""``python -m megatron_offgrpo.cli COMMAND ...`` is ``offgrpo COMMAND ...`` (for environments without the script)."""

from megatron_offgrpo.cli import main

if __name__ == "__main__":
    main()
