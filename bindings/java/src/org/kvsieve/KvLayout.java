// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

/** How a page of a caller's KV cache orders its tokens and heads (kvs_kv_layout, Session.bindKv):
 *  HND, [numKvHeads][pageSize][headDim] per page (the default), or NHD, [pageSize][numKvHeads][headDim]
 *  (vLLM's and FlashInfer's default). */
public enum KvLayout {
  HND(0), NHD(1);

  final int value;

  KvLayout(int v) { value = v; }
}
