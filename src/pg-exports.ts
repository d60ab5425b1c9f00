import pg from 'pg'

// pg's own exports, re-exported as they are. In a module of their own so that an app that imports
// only `httpSql` does not keep all of pg alive through them.
export const { types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } = pg
