// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

import java.util.Collections;
import java.util.EnumSet;
import java.util.List;
import java.util.Objects;
import java.util.Set;

/** A registered method: its name, one-line description, the backends it supports
 *  (kvs_method_backends) and its parameters, from {@link KvsNative#methods()}. Immutable. */
public final class MethodInfo {
  private final String name, doc;
  private final Set<Backend> backends;
  private final List<ParamInfo> params;

  MethodInfo(String name, String doc, Set<Backend> backends, List<ParamInfo> params) {
    this.name = Objects.requireNonNull(name, "name");
    this.doc = Objects.requireNonNull(doc, "doc");
    this.backends = Collections.unmodifiableSet(backends.isEmpty() ? EnumSet.noneOf(Backend.class)
                                                                   : EnumSet.copyOf(backends));
    this.params = List.copyOf(params);
  }

  /** The registry name, as Session.Builder.method takes it. */
  public String name() { return name; }

  /** One line ("" if the registry has none). */
  public String doc() { return doc; }

  /** The backends the method supports in this build (unmodifiable, in Backend order). */
  public Set<Backend> backends() { return backends; }

  /** The parameters, in registry order (unmodifiable). */
  public List<ParamInfo> params() { return params; }

  @Override public boolean equals(Object o) {
    if (this == o) return true;
    if (!(o instanceof MethodInfo)) return false;
    MethodInfo m = (MethodInfo) o;
    return name.equals(m.name) && doc.equals(m.doc) && backends.equals(m.backends) && params.equals(m.params);
  }

  @Override public int hashCode() { return Objects.hash(name, doc, backends, params); }

  @Override public String toString() {
    return "MethodInfo[name=" + name + ", doc=" + doc + ", backends=" + backends + ", params=" + params + "]";
  }
}
