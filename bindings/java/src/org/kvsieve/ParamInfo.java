// SPDX-License-Identifier: Apache-2.0
package org.kvsieve;

import java.util.Objects;

/** One parameter of a registered method (kvs_param_info), as the "key=value" pairs of
 *  {@code Session.Builder.methodParams} take it. Immutable. */
public final class ParamInfo {
  private final String name, type, defaultValue, doc;

  ParamInfo(String name, String type, String defaultValue, String doc) {
    this.name = Objects.requireNonNull(name, "name");
    this.type = Objects.requireNonNull(type, "type");
    this.defaultValue = Objects.requireNonNull(defaultValue, "defaultValue");
    this.doc = Objects.requireNonNull(doc, "doc");
  }

  /** The key, e.g. "page_size". */
  public String name() { return name; }

  /** "int", "float", "bool", "string", or "enum:a|b|c". */
  public String type() { return type; }

  /** The default, as text (e.g. "16"). */
  public String defaultValue() { return defaultValue; }

  /** One line. */
  public String doc() { return doc; }

  @Override public boolean equals(Object o) {
    if (this == o) return true;
    if (!(o instanceof ParamInfo)) return false;
    ParamInfo p = (ParamInfo) o;
    return name.equals(p.name) && type.equals(p.type) && defaultValue.equals(p.defaultValue) && doc.equals(p.doc);
  }

  @Override public int hashCode() { return Objects.hash(name, type, defaultValue, doc); }

  @Override public String toString() {
    return "ParamInfo[name=" + name + ", type=" + type + ", defaultValue=" + defaultValue + ", doc=" + doc + "]";
  }
}
