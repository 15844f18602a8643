// Package nilcheck tells a nil interface from one holding a nil pointer,
// which a plain == nil check misses: `var pool *pgxpool.Pool` passed as an
// interface is not == nil, and would panic on first use.
package nilcheck

import "reflect"

// IsNil reports whether v is nil or holds a nil pointer, map, slice,
// channel, function or interface.
func IsNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func, reflect.Interface:
		return rv.IsNil()
	}
	return false
}
