/**
 * The floor for SQL over HTTP with a database behind it: the least a hand-written endpoint does. A
 * bare Node HTTP server, run as a child process by the bench, that parses each request's JSON
 * ({query, params}), runs it on a pg.Pool (max 32) and answers its rows as JSON. No credentials
 * per request, no limits, no timeouts, no types: only HTTP plus a pg query.
 *
 *   node --import tsx bench/http-pg.ts <connection string>
 *
 * Prints {"listening":"127.0.0.1:PORT"} once ready; exits when its stdin closes (its parent died).
 */
import http from 'node:http'
import pg from 'pg'
import { announce } from './child'

const pool = new pg.Pool({ connectionString: process.argv[2], max: 32 })
const server = http.createServer((req, res) => {
  let body = ''
  req.setEncoding('utf8')
  req.on('data', (chunk) => (body += chunk))
  req.on('end', async () => {
    try {
      const { query, params } = JSON.parse(body)
      const result = await pool.query({ text: query, values: params, rowMode: 'array' })
      const json = JSON.stringify({ command: result.command, rowCount: result.rowCount, rows: result.rows })
      res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(json) })
      res.end(json)
    } catch (err) {
      res.writeHead(400, { 'content-type': 'text/plain' })
      res.end(String((err as Error).message))
    }
  })
})
server.keepAliveTimeout = 60_000
server.listen(0, '127.0.0.1', () => announce(server))
