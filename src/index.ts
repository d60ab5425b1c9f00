// Only re-exports: an app that imports `httpSql` alone leaves the whole WebSocket driver (and pg's
// Client) out of its bundle, since nothing here runs on import. The names after pg's and edgepg's
// own are @neondatabase/serverless's, so that edgepg can be installed under its name.
import { Client, Pool, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral, parseIntoClientConfig } from './client'
import { config } from './config'
import { httpSql, HttpQuery, NeonDbError, errorFields } from './http'

/** Neon's warning for a browser; edgepg works in browsers on purpose (with a token or a proxy that allows it), so it says nothing. */
const warnIfBrowser = () => {}

export { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
export type { ClientConfig, PoolConfig } from './client'
export type { EdgeConfig, GlobalConfig, WebSocketConstructor, WebSocketLike } from './config'
import type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification } from 'pg'
export type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification }

export { httpSql, HttpQuery, HttpSqlError } from './http'
export type { HttpSql, HttpQueryFunction, HttpSqlOptions, HttpQueryOptions, HttpTransactionOptions, HttpTransportOptions, HttpQueryResult, HttpPoolConfig, HttpTypes, IsolationLevel } from './http'

// @neondatabase/serverless's names, where the meaning is the same (docs/neon.md).
export { httpSql as neon, config as neonConfig, HttpQuery as NeonQueryPromise, NeonDbError, errorFields, warnIfBrowser, parseIntoClientConfig }
import type { HttpSql, HttpQueryOptions, HttpTransactionOptions, HttpQueryResult } from './http'
import type { GlobalConfig } from './config'
export type NeonQueryFunction<A extends boolean = false, F extends boolean = false> = HttpSql<A, F>
export type HTTPQueryOptions<A extends boolean = false, F extends boolean = false> = HttpQueryOptions<A, F>
export type HTTPTransactionOptions<A extends boolean = false, F extends boolean = false> = HttpTransactionOptions<A, F>
export type FullQueryResults<A extends boolean> = HttpQueryResult<A extends true ? any[] : Record<string, any>>
export type NeonConfig = GlobalConfig
export type { PoolClient as ClientBase }

export default {
  Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral,
  httpSql, neon: httpSql, neonConfig: config, NeonDbError, errorFields, warnIfBrowser, parseIntoClientConfig,
}
