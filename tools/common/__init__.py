"""What several commands share: the model options and how they resolve (defaults), command-line
text and one-line errors (cli_text), and the text side of `ggraph run` (run_loop). No commands."""
