"""dcr: bit-exact delta-compressed refit."""
