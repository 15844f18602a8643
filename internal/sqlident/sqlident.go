// Package sqlident validates and quotes SQL identifiers that come from
// configuration (schema names, table prefixes) before they reach SQL text.
package sqlident

import (
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// MaxLength is PostgreSQL's identifier limit (NAMEDATALEN - 1).
const MaxLength = 63

var valid = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)

// Validate returns an error naming field when name is not a plain SQL
// identifier: a letter or underscore followed by letters, digits or
// underscores, at most 63 bytes.
func Validate(field, name string) error {
	if !valid.MatchString(name) || len(name) > MaxLength {
		return fmt.Errorf("%s %q is not a valid SQL identifier: use letters, digits and underscores, starting with a letter or underscore, at most %d characters", field, name, MaxLength)
	}
	if strings.HasPrefix(name, "pg_") {
		// PostgreSQL refuses to create such a schema; say so before the
		// migration fails on it or a relay calls it "not migrated".
		return fmt.Errorf("%s %q starts with \"pg_\", which PostgreSQL reserves for system schemas: choose another name", field, name)
	}
	return nil
}

// Text returns an error naming field when v cannot be stored in a
// PostgreSQL text column as it is: invalid UTF-8 or a NUL byte.
func Text(field, v string) error {
	switch {
	case !utf8.ValidString(v):
		return fmt.Errorf("%s %q is not valid UTF-8: PostgreSQL cannot store it", field, v)
	case strings.IndexByte(v, 0) >= 0:
		return fmt.Errorf("%s %q contains a NUL byte: PostgreSQL cannot store it", field, v)
	}
	return nil
}

// Quote returns name as a double-quoted identifier. Callers validate first;
// Quote still escapes embedded quotes so it is safe on its own.
func Quote(name string) string {
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// Qualify returns "schema"."name".
func Qualify(schema, name string) string {
	return Quote(schema) + "." + Quote(name)
}

// SQL renders query for schema: every "{schema}" in it becomes the quoted
// schema name. eventline's statements are written as SQL, their tables
// named {schema}.processed_events and so on, and rendered once, when the
// component that runs them is built; schema has been validated by then.
func SQL(schema, query string) string {
	return strings.ReplaceAll(query, "{schema}", Quote(schema))
}
