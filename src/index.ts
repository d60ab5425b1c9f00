import { Client, Pool } from './client'
import { config } from './config'
import { types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } from './pg-exports'

export { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
export type { ClientConfig, PoolConfig } from './client'
export type { EdgeConfig, WebSocketConstructor } from './config'
import type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification } from 'pg'
export type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification }

export { httpSql, HttpQuery, HttpSqlError } from './http'
export type { HttpSql, HttpQueryFunction, HttpSqlOptions, HttpQueryOptions, HttpTransactionOptions, HttpTransportOptions, HttpQueryResult, HttpPoolConfig, HttpTypes, IsolationLevel } from './http'

export default { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
