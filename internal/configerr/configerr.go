// Package configerr is the error a configuration's validation returns. It
// names the field as the user wrote it: middleware.Config.MaxGap for the
// middleware's Config, consumer.Config.MaxGap for the same field of the
// consumer's Config, which embeds the middleware's and is validated by the
// same code.
package configerr

import (
	"errors"
	"fmt"
)

// Error is a configuration error of the struct named Struct; Err's message
// starts with the field's name ("MaxGap is -1; …").
type Error struct {
	Struct string
	Err    error
}

// Error implements error: Struct.Field and the problem.
func (e *Error) Error() string { return e.Struct + "." + e.Err.Error() }

// Unwrap returns Err.
func (e *Error) Unwrap() error { return e.Err }

// New returns an *Error of the struct named structName, its message
// formatted from format (which starts with the field's name) and args.
func New(structName, format string, args ...any) error {
	return &Error{Struct: structName, Err: fmt.Errorf(format, args...)}
}

// Rename returns err naming its struct structName when it is an *Error,
// else err itself.
func Rename(err error, structName string) error {
	var e *Error
	if !errors.As(err, &e) {
		return err
	}
	return &Error{Struct: structName, Err: e.Err}
}
