/**
 * The Postgres protocol's type bytes, in one table (as pg-protocol's MessageCodes), so that the
 * rest of the proxy names them. ClientMessage and backend messages share bytes: 'E' is Execute one way
 * and ErrorResponse the other.
 */
export const ClientMessage = {
  Bind: 0x42, // B
  Close: 0x43, // C
  Describe: 0x44, // D
  Execute: 0x45, // E
  FunctionCall: 0x46, // F
  Flush: 0x48, // H
  Parse: 0x50, // P
  Query: 0x51, // Q
  Sync: 0x53, // S
  Terminate: 0x58, // X
  CopyData: 0x64, // d
  CopyDone: 0x63, // c
  CopyFail: 0x66, // f
  /** PasswordMessage, and the SASL responses. */
  Password: 0x70, // p
} as const

export const ServerMessage = {
  ParseComplete: 0x31, // 1
  CloseComplete: 0x33, // 3
  CommandComplete: 0x43, // C
  ErrorResponse: 0x45, // E
  EmptyQueryResponse: 0x49, // I
  BackendKeyData: 0x4b, // K
  /** Also the answer to an SSLRequest that says no. */
  NoticeResponse: 0x4e, // N
  Authentication: 0x52, // R
  /** Also the answer to an SSLRequest that says yes. */
  ParameterStatus: 0x53, // S
  ReadyForQuery: 0x5a, // Z
  RowDescription: 0x54, // T
  DataRow: 0x44, // D
  NoData: 0x6e, // n
  ParameterDescription: 0x74, // t
  FunctionCallResponse: 0x56, // V
  NotificationResponse: 0x41, // A
} as const

/** Messages that carry no statement of their own. */
export const INERT = new Set<number>([ClientMessage.Describe, ClientMessage.Execute, ClientMessage.Sync, ClientMessage.Flush, ClientMessage.Close, ClientMessage.CopyData, ClientMessage.CopyDone, ClientMessage.CopyFail])

/** What a Describe or Close names. */
export const DescribeTarget = { Statement: 0x53, Portal: 0x50 } as const

/** The answer to an SSLRequest. */
export const SslAnswer = { Yes: 0x53, No: 0x4e } as const

/** ReadyForQuery's transaction status. */
export const TxStatus = { Idle: 0x49, InTransaction: 0x54, Failed: 0x45 } as const
