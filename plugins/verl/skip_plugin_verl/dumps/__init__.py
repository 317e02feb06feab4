"""The offline half of skip-plugin-verl: verl's pickled dumps (``gen_batch.dp``, TransferQueue's
``tq_batch.pt``) read without unpickling anything (``restricted_pickle``, ``torch_archive``,
``numpy_pickle``, ``verl_pickle``, ``tq_pickle``, under a byte budget: ``budget``) and
converted into verified skip entries by ``skip cache import-verl`` (``importing``,
``commands``). It needs neither verl nor a GPU, and nothing of the in-process half but the
layout of a batch (``skip_plugin_verl.tensordicts``)."""
