"""Small networks that draft from the target's own hidden states: the Kangaroo exit adapter
(``adapter``), EAGLE-1/2-style draft heads (``eagle``: cascade's ``DraftHead``), EAGLE-3 heads
(``eagle3``), pruned LM heads (``pruned_head``: FR-Spec), and their checkpoint files
(``checkpoints``)."""
